"""The whole engine on the Triton kernels (interpreted on the CPU) gives the reference's tokens.

Each kernel is tested against its twin on its own; this runs them together, through the model
code every family uses: a prompt, a long prompt, a one-token prompt, seeded parallel sampling
(copy-on-write through copy_blocks) and greedy decoding, every family, and the schedules that
feed attention its odd shapes (chunks, prefix-cache hits).
"""

import pytest

from pagedllm.optimized.backend import INTERPRETED_BACKEND
from pagedllm.reference import LLM, SamplingParams

from ..conftest import FAMILIES

PROMPTS = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19, 1)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, n=2),
          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def tokens(llm: LLM, prompts=PROMPTS) -> list:
    return [[c.token_ids for c in o.outputs]
            for o in llm.generate(prompts, PARAMS[:len(prompts)], use_tqdm=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_reference_tokens(checkpoints, family):
    expected = tokens(LLM(checkpoints[family], block_size=8, num_gpu_blocks=32))
    assert tokens(LLM(checkpoints[family], block_size=8, num_gpu_blocks=32,
                      backend=INTERPRETED_BACKEND)) == expected


@pytest.mark.parametrize("engine_args", [
    dict(enable_chunked_prefill=True, max_num_batched_tokens=8),
    dict(enable_prefix_caching=True),
], ids=["chunked", "prefix-cache"])
def test_chunks_and_prefix_hits_give_the_reference_tokens(checkpoints, engine_args):
    shared = list(range(3, 20))  # two full blocks of 8 shared, then each prompt's own tail
    prompts = [{"prompt_token_ids": shared + [30, 31]}, {"prompt_token_ids": shared + [40]}]
    expected = tokens(LLM(checkpoints["llama3"], block_size=8, num_gpu_blocks=32), prompts)
    llm = LLM(checkpoints["llama3"], block_size=8, num_gpu_blocks=32, backend=INTERPRETED_BACKEND,
              **engine_args)
    assert tokens(llm, prompts) == expected
    assert tokens(llm, prompts) == expected  # the second time, from the prefix cache
    if engine_args.get("enable_prefix_caching"):
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
