"""MLA's decode kernel compiled for the GPU, and the engine's latent and hybrid KV caches on
CUDA: the same tokens as on the CPU.

Tolerances, kernel against twin on the same CUDA tensors: float32 1e-4 absolute (the same sums
in another order, ~1e-6 apart); bf16 and fp16 2e-2 (the kernel keeps scores and the softmax in
float32 and rounds once, the twin rounds its products to the dtype).
"""

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.kernels.mla_decode import paged_mla_attention
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.ops.mla import paged_mla_attention as twin

from ..kernels.test_mla_decode_kernel import MIXED, make_batch


@pytest.fixture(autouse=True)
def _compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CUDA tensors: the compiled kernel


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2),
                                             (torch.float16, 2e-2)])
def test_mla_decode_kernel_at_deepseek_sizes(dtype, atol):
    """16 heads (one head block), rank 512, rotary 64: DeepSeek-V2's latent row."""
    batch = make_batch(0, 16, 16, 512, 64, seqs=MIXED, dtype=dtype)
    cuda = [t.cuda() for t in batch]
    got = paged_mla_attention(*cuda, 0.1)
    want = twin(*[t.float() if t.is_floating_point() else t for t in cuda], 0.1)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v2", "gemma3"])
def test_latent_and_hybrid_pools_give_the_cpu_s_tokens(tmp_path, family):
    path = write_random_checkpoint(tmp_path / family, tiny_config(family), seed=0,
                                   init_std=0.1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 30)]
    params = reference.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in reference.LLM(
        path, block_size=4, num_gpu_blocks=120).generate(prompts, params, use_tqdm=False)]
    for tier in (reference, optimized):
        llm = tier.LLM(path, device="cuda", dtype="float32", block_size=4, num_gpu_blocks=120)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, tier.__name__
        assert llm.stats()["blocks_used"] == 0
