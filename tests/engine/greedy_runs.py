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
