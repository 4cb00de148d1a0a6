"""What the KV-kind tests (sliding window, hybrid groups, latent attention) share: the
single-sequence loop's greedy tokens as the expected ones, greedy sampling parameters, and the
check that nothing is left in the pool once every request finished."""

import functools

from pagedllm.reference import generate, load_model


def single_sequence_loop(checkpoint):
    """tokens(prompt, max_tokens): the one-sequence loop's greedy tokens (a contiguous cache
    keeping every token's K/V, or latent row), computed once per prompt."""
    model = load_model(checkpoint)

    @functools.cache
    def tokens(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        return generate(model, list(prompt), max_tokens)
    return tokens


def greedy(tier, max_tokens: int, **kw):
    return tier.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def no_leak(llm) -> None:
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and llm.engine.kv.num_seqs == 0
    assert stats["swapped_blocks"] == 0


def check_shared_prefix_workload(tier, checkpoint, loop, reqs, mode: str, prefix: bool,
                                 chunked: bool, num_gpu_blocks: int,
                                 swap_space_blocks: int = 64) -> None:
    """The property the KV kinds' tests draw with hypothesis: requests (n, prompt length,
    starts with a shared 12-token prefix, max_tokens), greedy n > 1 samples (forked), prefix
    caching on or off, chunks of 16 tokens or whole prefills, and a pool small enough to
    preempt by `mode`: every sample's tokens are the loop's, and nothing leaks."""
    shared = list(range(200, 212))
    prompts = [(shared if starts else []) + [(7 * j + k) % 250 for j in range(length)]
               for k, (_, length, starts, _) in enumerate(reqs)]
    llm = tier.LLM(checkpoint, block_size=4, num_gpu_blocks=num_gpu_blocks,
                   preemption_mode=mode, swap_space_blocks=swap_space_blocks,
                   enable_prefix_caching=prefix, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=16 if chunked else 512)
    params = [greedy(tier, max_tokens, n=n) for n, _, _, max_tokens in reqs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, (n, _, _, max_tokens) in zip(prompts, outs, reqs, strict=True):
        assert [c.token_ids for c in out.outputs] == [loop(tuple(prompt), max_tokens)] * n
    no_leak(llm)
