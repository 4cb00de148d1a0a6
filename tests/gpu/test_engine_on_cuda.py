"""The engine runs unchanged on a GPU: the same tokens as on the CPU, greedy and seeded."""

import torch

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams


def test_engine_on_cuda_matches_cpu(checkpoints):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=12, ignore_eos=True)]
    runs = []
    for device in ("cpu", "cuda"):
        llm = LLM(checkpoints["llama3"], device=device, block_size=4, num_gpu_blocks=40,
                  preemption_mode="swap", swap_space_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        assert llm.stats()["blocks_used"] == 0
    assert runs[0] == runs[1]
    assert torch.cuda.is_available()
