"""Checks lesson 10's Triton exercise: decode attention's tile loop over the block table.

    pytest lessons/exercises/test_triton_paged_attention_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/triton_paged_attention_exercise.py (skipped while paged_decode still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 is set for every
test, and kernel_runner (kernels/runtime.py) reads it at each launch, so it does not matter
whether triton was imported before. The interpreter runs one program at a time: shapes are
small. The reference is pagedllm.reference.ops.paged_attention with one query per sequence.
Blocks are handed out shuffled, every slot no sequence wrote is NaN (so are the blocks the
padding entries of the block tables point at, and the memory around the pool), so reading one
slot too many, or the wrong block, turns the output into NaN.
"""

from dataclasses import dataclass

import pytest
import torch

from pagedllm.reference.ops import gather_kv, paged_attention

EXERCISE = "triton_paged_attention_exercise"  # impl (conftest.py): the solution's file, yours


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernel_runner reads it at every launch


@pytest.fixture
def decode(impl, _interpret):
    pool = torch.ones(1, 1, 1, 16)
    return impl.use("paged_decode", torch.ones(1, 1, 16), pool, pool,
                    torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), 1.0)


@dataclass
class Batch:
    """A batch of decodes over a paged pool, with the memory around each tensor poisoned."""

    q: torch.Tensor  # [B, heads, head_dim]
    k_arena: torch.Tensor  # [3 * num_blocks, block_size, kv_heads, head_dim]
    v_arena: torch.Tensor
    table_arena: torch.Tensor  # [9 * B, max_blocks + 1] int32: B rows, then the tables, ...
    seq_lens: torch.Tensor  # [B]
    scale: float

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches: the middle third of each NaN arena. A load before or past the pool
        reads NaN (memory the test owns) instead of whatever lies there, or a crash."""
        n = self.k_arena.shape[0] // 3
        return self.k_arena[n:2 * n], self.v_arena[n:2 * n]

    @property
    def block_tables(self) -> torch.Tensor:
        """[B, max_blocks + 1], the last column padding. Every entry around them (and every
        padding entry) names the same block of NaN, so reading a wrong entry shows as NaN."""
        b = len(self.seq_lens)
        return self.table_arena[b:2 * b]


def batch(seed, block_size, heads, kv_heads, head_dim, seq_lens, q_scale=1.0) -> Batch:
    """Random queries, and the sequences' K/V in shuffled blocks of a NaN pool."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned = free.pop()  # every entry the tables do not use points here: NaN, never read
    arena = (3 * num_blocks, block_size, kv_heads, head_dim)
    b = Batch(torch.randn(len(seq_lens), heads, head_dim, generator=gen) * q_scale,
              torch.full(arena, float("nan")), torch.full(arena, float("nan")),
              torch.full((9 * len(seq_lens), max(need) + 1), poisoned, dtype=torch.int32),
              torch.tensor(seq_lens), head_dim ** -0.5)
    k_cache, v_cache = b.pools()
    for s, n in enumerate(seq_lens):
        for i in range(need[s]):
            block = b.block_tables[s, i] = free.pop()
            used = min(block_size, n - i * block_size)  # slots past seq_len stay NaN
            k_cache[block, :used] = torch.randn(used, kv_heads, head_dim, generator=gen)
            v_cache[block, :used] = torch.randn(used, kv_heads, head_dim, generator=gen)
    return b


def reference(b: Batch) -> torch.Tensor:
    k_cache, v_cache = b.pools()
    one_each = torch.arange(len(b.seq_lens) + 1, dtype=torch.int32)  # query_start_loc
    return paged_attention(b.q, k_cache, v_cache, b.block_tables, b.seq_lens, one_each,
                           b.scale)


def explain(got: torch.Tensor, want: torch.Tensor, b: Batch) -> str | None:
    """What is wrong with out [B, heads, head_dim], and where to look; None if nothing."""
    block_size = b.k_arena.shape[1]
    heads, kv_heads = b.q.shape[1], b.k_arena.shape[2]
    if got.shape != want.shape:
        return (f"out has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
                f"\nout의 형태 {tuple(got.shape)}, 기대값 {tuple(want.shape)}")
    close = torch.isclose(got, want, atol=1e-5, rtol=1e-5).all(dim=-1)  # [B, heads]
    if close.all():
        return None
    seq, head = (int(i) for i in (~close).nonzero()[0])
    n = int(b.seq_lens[seq])
    table = b.block_tables[seq].tolist()[:-(-n // block_size)]
    where = (f"sequence {seq} (seq_len {n}, block_size {block_size}, block table {table}), "
             f"query head {head}")
    if not torch.isfinite(got[seq, head]).all():
        nan_slot = (f"a NaN slot was loaded: a slot at or past seq_len (the last block holds "
                    f"{n - (n - 1) // block_size * block_size} of {block_size}), a table entry "
                    f"past the last block, or an address outside the pool. Mask the loads "
                    f"(other=0), not only the scores: 0 * NaN is NaN"
                    f"\nNaN 슬롯을 읽었습니다: seq_len 이후의 슬롯(마지막 블록에는 {block_size}칸 "
                    f"중 {n - (n - 1) // block_size * block_size}칸이 찼습니다), 마지막 블록 뒤의 "
                    "테이블 항목, 또는 풀 밖의 주소입니다. 점수만이 아니라 load도 "
                    "마스킹하세요(other=0): 0 * NaN은 NaN입니다")
        keys = gather_kv(b.pools()[0], b.block_tables[seq], n)[:, head // (heads // kv_heads)]
        top = float((keys @ b.q[seq, head]).max() * b.scale)  # the largest score of the row
        if top > 80:
            return (f"{where}: not finite, with scores up to {top:.0f}. Either exp overflowed "
                    f"(float32's exp is inf past 88, and inf / inf is NaN: subtract the running "
                    f"max before exp), or {nan_slot}"
                    f"\n(또는 점수가 최대 {top:.0f}이므로 exp가 넘쳤을 수도 있습니다: float32의 "
                    "exp는 88을 넘으면 inf이고 inf / inf는 NaN입니다. exp 전에 누적 최댓값을 "
                    "빼세요)")
        return f"{where}: not finite: {nan_slot}"
    if (b.seq_lens <= block_size).any() and close[b.seq_lens <= block_size].all():
        hint = ("sequences within one block are right, longer ones wrong: each block's table "
                "entry, and l and acc rescaled by exp(m_old - m_new) when the max rises?"
                "\n블록 하나에 드는 시퀀스는 맞고 더 긴 시퀀스는 틀립니다: 블록마다 테이블 항목을 "
                "새로 읽었나요? 최댓값이 커질 때 l과 acc를 exp(m_old - m_new)로 다시 "
                "스케일했나요?")
    elif heads != kv_heads and close[:, 0].all():
        hint = (f"query head 0 is right, head {head} wrong: query head h reads K/V head "
                f"h // {heads // kv_heads} here"
                f"\n쿼리 헤드 0은 맞고 헤드 {head}는 틀립니다: 여기서 쿼리 헤드 h는 K/V 헤드 h // "
                f"{heads // kv_heads}를 읽습니다")
    else:
        error = float((got[seq, head] - want[seq, head]).abs().max())
        hint = (f"max error {error:.3g}. Wrong keys or values read? Logical block i is "
                f"block_tables[b * max_blocks + i]; its slot s, K/V head g, at row "
                f"(block * BLOCK_SIZE + s) * num_kv_heads + g"
                f"\n최대 오차 {error:.3g}. 잘못된 키나 값을 읽었나요? 논리 블록 i는 "
                "block_tables[b * max_blocks + i]이고, 그 슬롯 s의 K/V 헤드 g는 행 (block * "
                "BLOCK_SIZE + s) * num_kv_heads + g에 있습니다")
    return f"{where} differs from the reference: {hint}"


def check(decode, b: Batch) -> None:
    k_cache, v_cache = b.pools()
    got = decode(b.q, k_cache, v_cache, b.block_tables, b.seq_lens, b.scale)
    problem = explain(got, reference(b), b)
    assert problem is None, problem


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (4, 1, 24)])
def test_matches_reference(decode, block_size, heads, kv_heads, head_dim):
    """MHA, GQA (4 query heads per K/V head) and MQA with a head of 24 (a tile of 32 lanes),
    over a sequence of one token, of one full block, one past a block, one short of three, and
    two blocks and a few."""
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 2 * block_size + 3]
    check(decode, batch(block_size * 10 + heads, block_size, heads, kv_heads, head_dim, lens))


def test_one_key_is_its_value(decode):
    """With a single key its probability is 1: every head of the group outputs that value."""
    b = batch(0, 4, 4, 2, 16, [1])
    k_cache, v_cache = b.pools()
    got = decode(b.q, k_cache, v_cache, b.block_tables, b.seq_lens, b.scale)
    value = v_cache[b.block_tables[0, 0], 0]  # [kv_heads, head_dim]
    torch.testing.assert_close(got[0], value.repeat_interleave(2, dim=0),
                               msg=("one key: out[b, h] must be v of K/V head h // group"
                                    "\n키 하나: out[b, h]는 K/V 헤드 h // group의 v여야 합니다"))


def test_the_table_decides_the_order(decode):
    """The same keys and values stored twice, in different blocks and orders: the outputs must
    be the same, since attention follows the table, never the pool's order."""
    b = batch(1, 4, 4, 2, 16, [11, 11])
    k_cache, v_cache = b.pools()
    first = b.block_tables[0, :3].clone()
    second = b.block_tables[1, :3][torch.tensor([2, 0, 1])]  # the other blocks, reordered
    b.block_tables[1, :3] = second
    k_cache[second.long()] = k_cache[first.long()]  # logical block i of both: the same tokens
    v_cache[second.long()] = v_cache[first.long()]
    b.q[1] = b.q[0]
    got = decode(b.q, k_cache, v_cache, b.block_tables, b.seq_lens, b.scale)
    torch.testing.assert_close(got[1], got[0], atol=1e-6, rtol=1e-6,
                               msg=f"blocks {first.tolist()} and {second.tolist()} hold the "
                                   f"same tokens in that order, yet gave different outputs"
                                   f"\n블록 {first.tolist()}, {second.tolist()}: 같은 토큰을 같은 "
                                   "순서로 담는데도 다른 출력을 냈습니다")
    check(decode, b)


def test_large_scores_do_not_overflow(decode):
    """Scores in the hundreds: exp(score) is inf in float32, exp(score - max) is not."""
    check(decode, batch(2, 4, 4, 2, 16, [3, 9, 14], q_scale=150.0))


def test_max_rises_in_a_later_block(decode):
    """Each block's keys score higher than the last's (0.75 more per position, for head 0):
    what was summed against an older max must be rescaled at every block."""
    b = batch(3, 4, 2, 1, 16, [13])
    k_cache, _ = b.pools()
    q = b.q[0, 0]
    for p in range(13):
        k_cache[b.block_tables[0, p // 4], p % 4, 0] = q / q.norm() * (
            0.75 * p / (q.norm() * b.scale))  # score q . k * scale = 0.75 p
    check(decode, b)
