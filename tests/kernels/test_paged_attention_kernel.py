"""The paged attention kernel against its torch twin, on the CPU through Triton's interpreter.

Every batch mixes the query shapes of one engine step (decodes, a chunk, a whole prompt, a
prefix-cache hit) with contexts ending mid-block, and every cache slot the kernel must not read
is NaN: blocks in no table, slots past a sequence's length, the block the padding entries of the
block tables point at. The output is NaN before the launch, so a row the kernel forgets shows.
Rows past the last sequence (padding of T) must come out as 0, the twin's value.

The interpreter runs one program at a time in numpy (tens of milliseconds each): shapes are tiny
and the cases are chosen to cover each feature a few times, not as a cartesian product.
"""

import zlib

import pytest
import torch

from pagedllm.kernels import paged_attention as pa
from pagedllm.kernels.paged_attention import choose_num_splits, paged_attention
from pagedllm.kernels.runtime import kernel_runner
from pagedllm.reference.ops import paged_attention as twin

# (q_len, seq_len) per sequence: a decode, a chunk (23 tokens already cached), a whole prompt,
# a prefix-cache hit (only the last 3 of 35 tokens computed), a decode filling a block exactly.
MIXED = ((1, 37), (6, 29), (19, 19), (3, 35), (1, 8))
# prefill first, decodes after, no padding rows: the last program's sequence ends T exactly
PREFILL_FIRST = ((24, 40), (1, 17), (1, 64), (9, 9))
LONG_DECODES = ((1, 700), (1, 515))  # long enough for the heuristic to split
PAD_ROWS = 3  # rows of q past the last sequence


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_batch(seed: int, block_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
               seqs=MIXED, pad_rows: int = PAD_ROWS, dtype=torch.float32, device="cpu",
               spare_blocks: int = 3):
    """Random q and a paged cache holding the sequences' K/V in shuffled blocks; every other slot
    NaN. Returns q, k_cache, v_cache, block_tables, seq_lens, query_start_loc (int32, on device).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned = free.pop()  # what the padding entries of the tables point at: NaN
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), poisoned, dtype=torch.int32)
    for b, (_, seq_len) in enumerate(seqs):
        for i in range(blocks_per_seq[b]):
            block = free.pop()
            block_tables[b, i] = block
            filled = min(block_size, seq_len - i * block_size)  # slots past seq_len stay NaN
            k_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, generator=gen)
            v_cache[block, :filled] = torch.randn(filled, num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(q_len for q_len, _ in seqs) + pad_rows
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    seq_lens = torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
            block_tables.to(device), seq_lens.to(device), query_start_loc.to(device))


def check(batch, scale, window, tol, **kwargs):
    """Launch on a NaN-poisoned output and compare with the twin (in fp32); return the output."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = batch
    expected = twin(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens,
                    query_start_loc, scale, window)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          window, out=out, **kwargs)
    assert got is out and got.dtype == q.dtype
    assert not got.isnan().any(), "a row or head was left unwritten (or read a NaN slot)"
    assert (got.float() - expected).abs().max().item() < tol
    last = int(query_start_loc[-1])
    assert torch.equal(got[last:], torch.zeros_like(got[last:])), "padding rows must be 0"
    return got


# id: block_size, head_dim, num_heads, num_kv_heads, sliding_window, launcher keywords
CASES = {
    "bs16-d64-mha": (16, 64, 4, 4, None, {}),
    "bs8-d128-gqa4-window7": (8, 128, 8, 2, 7, {}),
    "bs32-d80-mqa8": (32, 80, 8, 1, None, {}),
    "bs16-d96-gqa8-window16": (16, 96, 16, 2, 16, {}),
    "bs8-d64-mqa4-window1": (8, 64, 4, 1, 1, {}),
    "bs16-d64-gqa4-rows16": (16, 64, 8, 2, None, {"block_m": 16}),  # many query blocks
    "bs32-d64-gqa4-rows64-tile16": (32, 64, 8, 2, 5, {"block_m": 64, "tile_n": 16}),  # half blocks
    "bs8-d80-mha-tile64": (8, 80, 2, 2, None, {"tile_n": 64}),  # eight blocks per tile
    "bs16-d64-gqa3-rows16": (16, 64, 6, 2, None, {"block_m": 16}),  # group not a power of 2
    # flash-decoding forced on mixed batches: the split path handles any query shape
    "split3-bs16-d64-gqa4": (16, 64, 8, 2, None, {"num_splits": 3}),
    "split4-bs8-d80-mqa8-window10": (8, 80, 8, 1, 10, {"num_splits": 4}),  # empty splits
    "split2-bs32-d128-mha": (32, 128, 4, 4, None, {"num_splits": 2, "block_m": 16}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_batch_matches_twin(case):
    block_size, head_dim, num_heads, num_kv_heads, window, kwargs = CASES[case]
    batch = make_batch(zlib.crc32(case.encode()), block_size, head_dim, num_heads, num_kv_heads)
    check(batch, head_dim ** -0.5, window, 1e-4, **kwargs)


@pytest.mark.parametrize("num_splits", [None, 2])
@pytest.mark.parametrize("block_size,head_dim,num_heads,num_kv_heads,window", [
    (32, 96, 8, 2, 12), (8, 64, 8, 8, None)], ids=["bs32-d96-gqa4-window12", "bs8-d64-mha"])
def test_prefill_first_without_padding(block_size, head_dim, num_heads, num_kv_heads, window,
                                       num_splits):
    batch = make_batch(zlib.crc32(f"{block_size}-{num_splits}".encode()), block_size, head_dim,
                       num_heads, num_kv_heads, seqs=PREFILL_FIRST, pad_rows=0)
    check(batch, head_dim ** -0.5, window, 1e-4, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 1], ids=["heuristic-split", "single-pass"])
@pytest.mark.parametrize("window", [None, 300])
def test_long_decodes_split_and_single_pass(num_splits, window):
    """A batch of decodes with long contexts: the heuristic splits it; forcing 1 must agree."""
    assert choose_num_splits(len(LONG_DECODES), 2, 1, 700) > 1
    batch = make_batch(zlib.crc32(f"long-{window}".encode()), 16, 64, 8, 2, seqs=LONG_DECODES)
    check(batch, 0.125, window, 1e-4, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_half_precision(dtype, num_splits):
    """bf16/fp16 inputs, fp32 accumulation. The twin in fp32 on the same (rounded) inputs is the
    truth; the kernel rounds the probabilities to the input type before P·V (as the twin does in
    its own dtype) and its output once: a few units of the last place of values around 1."""
    batch = make_batch(zlib.crc32(str(dtype).encode()) + num_splits, 16, 64, 8, 2, dtype=dtype)
    check(batch, 0.125, None, 2e-2 if dtype == torch.bfloat16 else 4e-3, num_splits=num_splits)


def test_default_output_and_int64_metadata():
    """Without out=, a fresh tensor; seq_lens / query_start_loc of another integer type."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(7, 16, 64, 4, 2)
    expected = twin(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125)
    got = paged_attention(q, k_cache, v_cache, block_tables, seq_lens.long(),
                          query_start_loc.long(), 0.125)
    assert (got - expected).abs().max().item() < 1e-4


def test_single_decode_of_one_token():
    batch = make_batch(11, 8, 64, 4, 4, seqs=((1, 1),), pad_rows=0, spare_blocks=0)
    check(batch, 0.125, None, 1e-4)


def test_without_interpreter_the_launcher_calls_the_twin(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(3, 16, 64, 4, 2)
    assert kernel_runner(pa._paged_attention_kernel, q, k_cache) is None
    expected = twin(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125, 4)
    got = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125, 4)
    assert torch.equal(got, expected)


def test_heads_must_split_into_groups():
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = make_batch(5, 16, 64, 3, 2)
    with pytest.raises(ValueError, match="groups"):
        paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 0.125)


def test_split_heuristic():
    # prefills and mixed batches never split; short contexts do not either
    assert choose_num_splits(4, 8, max_query_len=7, max_seq_len=8192) == 1
    assert choose_num_splits(4, 8, max_query_len=1, max_seq_len=300) == 1
    # few long decodes: split, bounded by the context and by MAX_SPLITS
    assert choose_num_splits(1, 8, 1, 8192) == pa.MAX_SPLITS
    assert choose_num_splits(1, 8, 1, 3 * pa.MIN_KEYS_PER_SPLIT) == 3
    # a batch that already fills the GPU runs in one pass
    assert choose_num_splits(256, 8, 1, 8192, num_sms=132) == 1
