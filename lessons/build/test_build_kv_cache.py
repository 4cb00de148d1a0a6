"""Milestone 1, the paged KV pool: writes land in their slots only, attention reads only what
was written, block copies copy whole blocks in every layer.

    pytest lessons/build/test_build_kv_cache.py

Each test runs on the solution and on lessons/build/kv_cache.py (skipped until written).
"""

import pytest
import torch
from build_track import expect

from pagedllm.reference.ops import causal_attention

PIECE = "kv_cache"
NAN = float("nan")


def write(cache: torch.Tensor, table: list[int], rows: torch.Tensor) -> None:
    """The test's own write of a sequence's rows [n, kv_heads, head_dim] at positions 0..n-1."""
    bs = cache.shape[1]
    for p in range(rows.shape[0]):
        cache[table[p // bs], p % bs] = rows[p]


def test_allocate(impl):
    k, v = impl.allocate_kv_cache(3, 5, 4, 2, 8, torch.float64)
    assert len(k) == 3 and len(v) == 3, ("one K and one V tensor per layer"
                                         "\n레이어마다 K 텐서 하나와 V 텐서 하나")
    for t in (*k, *v):
        assert t.shape == (5, 4, 2, 8), (
            f"a layer's pool is [num_blocks, block_size, kv_heads, head_dim], got {t.shape}"
            "\n레이어의 풀은 [num_blocks, block_size, kv_heads, head_dim]이어야 하는데, 결과는 "
            f"{t.shape}")
        assert t.dtype == torch.float64 and t.device.type == "cpu"
    storages = {t.untyped_storage().data_ptr() for t in (*k, *v)}
    assert len(storages) == 6, ("two of the pool's tensors share memory: then a write to one "
                                "layer (or to K) would also change another; give each its own"
                                "\n풀의 텐서 두 개가 메모리를 공유합니다: 그러면 한 레이어(또는 "
                                "K)에 쓸 때 다른 텐서도 바뀝니다. 텐서마다 자기 메모리를 주세요")


def test_store_writes_its_slots_and_nothing_else(impl):
    k_cache = torch.full((4, 2, 1, 3), -7.0)  # 8 slots, each holding -7 before the write
    v_cache = torch.full((4, 2, 1, 3), -7.0)
    k = torch.arange(12.0).view(4, 1, 3)
    v = -torch.arange(12.0).view(4, 1, 3)
    impl.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 2]))
    flat_k, flat_v = k_cache.view(8, 1, 3), v_cache.view(8, 1, 3)
    for row, slot in ((0, 5), (2, 0), (3, 2)):
        expect(torch.equal(flat_k[slot], k[row]) and torch.equal(flat_v[slot], v[row]),
               f"row {row} belongs in slot {slot} (block {slot // 2}, offset {slot % 2})")
    expect(torch.all(flat_k[7] == -7) and torch.all(flat_v[7] == -7), (
        "slot -1 marks a padding row, which must write nothing; it was written into the last "
        "slot of the pool, where another sequence's K/V may live (index -1 in Python)"))
    untouched = [s for s in range(8) if s not in (0, 2, 5)]
    expect(torch.all(flat_k[untouched] == -7) and torch.all(flat_v[untouched] == -7),
           "a slot nobody wrote to changed")


def sequences():
    """Three sequences in one step, their K/V scattered over a pool whose unused slots are NaN:
    a whole prompt, a decode, and a prompt whose first 8 tokens were cached (3 new rows)."""
    torch.manual_seed(0)
    bs, kvh, hd = 4, 2, 8
    tables = [[3, 6], [5, 1, 7], [2, 8, 4]]  # block 0 is never used: padding points at it
    seq_lens, q_lens = [7, 10, 11], [7, 1, 3]
    k_cache = torch.full((9, bs, kvh, hd), NAN)
    v_cache = torch.full((9, bs, kvh, hd), NAN)
    keys = [torch.randn(n, kvh, hd) for n in seq_lens]
    values = [torch.randn(n, kvh, hd) for n in seq_lens]
    for table, k, v in zip(tables, keys, values, strict=True):
        write(k_cache, table, k)
        write(v_cache, table, v)
    block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, 7, 8, 11], dtype=torch.int32)
    q = torch.randn(11, 4, hd)  # 4 query heads over 2 K/V heads
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=starts,
                keys=keys, values=values, q_lens=q_lens)


def dense(case: dict) -> list[torch.Tensor]:
    """What each sequence's rows must be: causal attention over its whole history."""
    outs, start = [], 0
    for k, v, q_len in zip(case["keys"], case["values"], case["q_lens"], strict=True):
        n = k.shape[0]
        pos = torch.arange(n)
        outs.append(causal_attention(case["q"][start:start + q_len], k, v, pos[n - q_len:],
                                     pos, 0.5))
        start += q_len
    return outs


def check_rows(out: torch.Tensor, case: dict) -> None:
    names = ["the prompt (7 rows)", "the decode (1 row at position 9)",
             "the cached prompt (3 rows at positions 8..10)"]
    assert out.shape == case["q"].shape, (f"one output row per query row: {out.shape}"
                                          f"\n쿼리 행마다 출력 행 하나: {out.shape}")
    start = 0
    for name, want, q_len in zip(names, dense(case), case["q_lens"], strict=True):
        got = out[start:start + q_len]
        expect(not got.isnan().any(), (
            f"{name}: NaN in the output. Every slot nobody wrote holds NaN here: attention "
            "read a slot past the sequence's length (the rest of its last block), or a "
            "block behind a padding entry of its block table. Masking after reading is not "
            "enough: NaN * 0 is NaN"))
        expect(torch.allclose(got, want, rtol=1.3e-6, atol=1e-5), (
            f"{name}: wrong rows. The rows of a sequence are its last q_len tokens, and "
            "position p lives in block_table[p // block_size] at offset p % block_size"))
        start += q_len


def test_attention_reads_only_written_slots(impl):
    case = sequences()
    out = impl.paged_attention(case["q"], case["k_cache"], case["v_cache"],
                               case["block_tables"], case["seq_lens"],
                               case["query_start_loc"], 0.5)
    check_rows(out, case)


def test_many_decodes_in_one_step(impl):
    """Eight decodes of different lengths, one query row each, in one call."""
    torch.manual_seed(1)
    bs, kvh, hd = 2, 1, 4
    lens = [1, 2, 3, 5, 8, 4, 7, 6]
    k_cache = torch.full((40, bs, kvh, hd), NAN)
    v_cache = torch.full((40, bs, kvh, hd), NAN)
    free = list(torch.randperm(39).add(1).tolist())  # blocks 1..39, scattered
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // bs))]
        k, v = torch.randn(n, kvh, hd), torch.randn(n, kvh, hd)
        write(k_cache, table, k)
        write(v_cache, table, v)
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(map(len, tables))
    q = torch.randn(len(lens), 2, hd)
    out = impl.paged_attention(
        q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.arange(len(lens) + 1, dtype=torch.int32),
        1.0)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        want = causal_attention(q[b:b + 1], keys[b], values[b], pos[n - 1:], pos, 1.0)
        what = f"decode {b} ({n} tokens in the cache)"
        expect(not out[b].isnan().any(),
               f"{what}: read a slot past its length, or a padding block")
        expect(torch.allclose(out[b:b + 1], want, rtol=1.3e-6, atol=1e-5),
               f"{what}: wrong output; its query is at position {n - 1}")


def test_store_then_attend(impl):
    """What a layer does: store this step's K/V at their slots, then attend over the pool."""
    case = sequences()
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    # Forget the new tokens' K/V, then store them back through store_kv (with a padding row).
    news, slots = [], []
    for b, table in enumerate(case["block_tables"].tolist()):
        n, q_len = int(case["seq_lens"][b]), case["q_lens"][b]
        for p in range(n - q_len, n):
            slot = table[p // 4] * 4 + p % 4
            k_cache.view(-1, 2, 8)[slot] = NAN
            v_cache.view(-1, 2, 8)[slot] = NAN
            news.append((case["keys"][b][p], case["values"][b][p]))
            slots.append(slot)
    k = torch.stack([kk for kk, _ in news] + [torch.zeros(2, 8)])
    v = torch.stack([vv for _, vv in news] + [torch.zeros(2, 8)])
    impl.store_kv(k, v, k_cache, v_cache, torch.tensor(slots + [-1]))
    out = impl.paged_attention(case["q"], k_cache, v_cache, case["block_tables"],
                               case["seq_lens"], case["query_start_loc"], 0.5)
    check_rows(out, case)


def test_copy_blocks(impl):
    torch.manual_seed(2)
    k = [torch.randn(5, 2, 1, 3) for _ in range(2)]
    v = [torch.randn(5, 2, 1, 3) for _ in range(2)]
    before = [t.clone() for t in (*k, *v)]
    impl.copy_blocks(k, v, [])
    expect(all(torch.equal(a, b) for a, b in zip((*k, *v), before, strict=True)),
           "no pairs: nothing changes")
    impl.copy_blocks(k, v, [(1, 3), (4, 0)])
    for i, (t, old) in enumerate(zip((*k, *v), before, strict=True)):
        what = f"{'KV'[i // 2]} of layer {i % 2}"
        expect(torch.equal(t[3], old[1]) and torch.equal(t[0], old[4]),
               f"{what}: block dst must become a copy of block src (every layer, K and V)")
        for block in (1, 2, 4):
            expect(torch.equal(t[block], old[block]),
                   f"{what}: block {block} changed; only the dst blocks may")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_keeps_the_pool_dtype(impl, dtype):
    k_caches, v_caches = impl.allocate_kv_cache(1, 2, 2, 1, 2, dtype)
    impl.store_kv(torch.ones(1, 1, 2, dtype=dtype), torch.ones(1, 1, 2, dtype=dtype),
                  k_caches[0], v_caches[0], torch.tensor([3]))
    expect(k_caches[0].dtype == dtype and k_caches[0].view(4, 1, 2)[3].eq(1).all(),
           "store_kv writes into the pool it is given, in place")
