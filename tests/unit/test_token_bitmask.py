"""The grammar's token bitmask: the reference op against xgrammar's own, the sampler never
drawing a forbidden token, and fill_bitmask's rows (all ones without a grammar; min_tokens'
blocked tokens let through where the grammar allows nothing else)."""

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams as Spec
from pagedllm.reference.engine.structured_outputs.grammar import GrammarCache, fill_bitmask
from pagedllm.reference.ops.sampling import (
    SamplingMetadata,
    SamplingRow,
    apply_token_bitmask,
    sample,
    unpack_bitmask,
)
from pagedllm.serving.default_model import default_model_dir


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-2**31, 2**31, (rows, words), generator=g, dtype=torch.int64).to(
        torch.int32)


def test_the_twin_matches_xgrammars_apply_token_bitmask_inplace():
    for vocab, seed in ((32, 0), (33, 1), (1000, 2), (4096, 3)):
        logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(seed))
        bitmask = random_bitmask(5, vocab, seed)
        bitmask[0] = -1  # all allowed
        bitmask[1] = 0  # none
        bitmask[2, 0] = -2**31  # only bit 31 (the sign bit) of the first word
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(apply_token_bitmask(logits, bitmask), want)


def test_unpack_reads_bit_t_mod_32_of_word_t_div_32():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 30)
    bitmask[0, 1] = -2**31 | 1  # tokens 63 and 32
    allowed = unpack_bitmask(bitmask, 64)[0].nonzero()[:, 0].tolist()
    assert allowed == [3, 30, 32, 63]
    assert unpack_bitmask(bitmask, 40).shape == (1, 40)  # the padding bits are cut off


def test_the_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs():
    vocab = 70
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(4, 3, dtype=torch.int32)
    allowed = [[5], [5, 40, 69], [0, 1, 2, 3], list(range(vocab))]
    for r, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[r, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -2**31
    for seed in range(20):
        rows = [SamplingRow(temperature=t, stream=seed, top_k=k)
                for t, k in ((0.0, -1), (1.0, -1), (2.0, 2), (0.7, -1))]
        out = sample(logits, SamplingMetadata.from_rows(rows, vocab, token_bitmask=bitmask))
        for r, token in enumerate(out.token_ids.tolist()):
            assert token in allowed[r]
        raw = torch.log_softmax(logits, dim=-1)
        assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])


def test_fill_bitmask_rows():
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    vocab = len(tokenizer)
    cache = GrammarCache(tokenizer, vocab, tokenizer.eos_token_id)
    matcher = cache.matcher(cache.get(Spec(choice=["yes"])))
    blocked = [[], [tokenizer.eos_token_id]]
    mask = fill_bitmask([None, matcher], blocked, vocab)
    assert mask.shape == (2, (vocab + 31) // 32) and bool((mask[0] == -1).all())
    first = unpack_bitmask(mask[1:], vocab)[0]
    assert 0 < int(first.sum()) < vocab  # the tokens that start "yes"
    assert blocked[1] == [tokenizer.eos_token_id]  # other tokens are allowed: still blocked
    for token in tokenizer("yes")["input_ids"]:
        assert matcher.accept_token(token)
    mask = fill_bitmask([matcher], blocked[1:], vocab)
    assert unpack_bitmask(mask, vocab)[0].nonzero()[:, 0].tolist() == [tokenizer.eos_token_id]
    assert blocked[1] == []  # only EOS may follow: min_tokens gives way to the grammar
