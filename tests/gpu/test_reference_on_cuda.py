"""The reference tier runs unchanged on a GPU and agrees with itself on the CPU."""

import torch

from pagedllm.reference import generate, load_model


def test_cuda_generation_matches_cpu(checkpoints):
    path = checkpoints["llama3"]
    prompt = list(range(1, 20))
    cpu = generate(load_model(path), prompt, 16)
    gpu = generate(load_model(path, device="cuda"), prompt, 16)
    assert gpu == cpu
    assert torch.cuda.is_available()
