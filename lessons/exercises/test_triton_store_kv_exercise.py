"""Checks lesson 13's Triton exercise: store_kv as a kernel, writing each token at its slot.

    pytest lessons/exercises/test_triton_store_kv_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/triton_store_kv_exercise.py (skipped while store_kv still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The kernels run on the CPU through Triton's interpreter: TRITON_INTERPRET=1 is set for every
test, and kernel_runner (kernels/runtime.py) reads it at each launch, so it does not matter
whether triton was imported before. The interpreter runs one program at a time: shapes are
small. The reference is pagedllm.reference.ops.store_kv, and the comparison is exact: a copy
computes nothing. Every slot of the pool starts as NaN, so a row written to the wrong slot, a
padding row (slot -1) stored anywhere, or a row left out all show.
"""

from dataclasses import dataclass

import pytest
import torch

from pagedllm.reference.ops import store_kv as store_kv_reference

EXERCISE = "triton_store_kv_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernel_runner reads it at every launch


@pytest.fixture
def store(impl, _interpret):
    one = torch.ones(1, 1, 1)
    return impl.use("store_kv", one, one, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                    torch.tensor([0]))


@dataclass
class Case:
    k: torch.Tensor  # [T, kv_heads, head_dim]
    v: torch.Tensor
    slots: torch.Tensor  # [T], -1 for padding rows
    k_arena: torch.Tensor  # [3 * num_blocks, block_size, kv_heads, head_dim], all NaN
    v_arena: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k_arena.shape[0] // 3

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches handed to store_kv: the middle third of each arena. The thirds before
        and after catch a write outside the pool (slot -1 taken as a slot, an address off by a
        factor) instead of letting it corrupt memory the interpreter uses."""
        n = self.num_blocks
        return self.k_arena[n:2 * n], self.v_arena[n:2 * n]


def case(seed, block_size, kv_heads, head_dim, num_blocks=4, num_tokens=9, num_padding=3,
         fused=False) -> Case:
    """k, v [T, kv_heads, head_dim], NaN pools, and distinct slots [T] with -1 padding rows."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    if fused:  # views into a [T, q | k | v] projection output: rows are not contiguous
        qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen)
        k, v = qkv[:, 1], qkv[:, 2]
    else:
        k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
        v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen)
    arena = (3 * num_blocks, block_size, kv_heads, head_dim)
    return Case(k, v, slots, torch.full(arena, float("nan")), torch.full(arena, float("nan")))


def same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def explain(name, arena, want, c: Case, slots):
    """What is wrong in one pool (its arena) after the launch, in the words of the contract;
    None if nothing is. want: the pool the twin wrote."""
    n, block_size = c.num_blocks, arena.shape[1]
    before, pool, after = arena[:n].flatten(0, 1), arena[n:2 * n], arena[2 * n:].flatten(0, 1)
    rows = {"K": c.k, "V": c.v}
    owner = {s: t for t, s in enumerate(slots.tolist()) if s >= 0}
    padding = [t for t, s in enumerate(slots.tolist()) if s < 0]
    if not before.isnan().all():
        last = int((~before.isnan()).flatten(1).any(1).nonzero().max()) - before.shape[0]
        hint = ("slot -1 taken as a slot: a padding row must store nothing" if last == -1
                else "an address computed below the pool's start")
        return (f"{name}: your kernel wrote before the pool, at slot {last} ({hint})"
                f"\n{name}: 커널이 풀 앞, 슬롯 {last}에 썼습니다({hint})")
    if not after.isnan().all():
        return (f"{name}: your kernel wrote past the pool's end: element (slot, h, d) of the pool "
                f"lies at (slot * kv_heads + h) * head_dim + d"
                f"\n{name}: 커널이 풀의 끝을 넘어서 썼습니다: 풀의 원소 (slot, h, d)는 (slot * "
                "kv_heads + h) * head_dim + d에 있습니다")
    flat_got, flat_want = pool.flatten(0, 1), want.flatten(0, 1)  # [slots, kv_heads, head_dim]
    for slot in range(flat_got.shape[0]):
        g = flat_got[slot]
        if same(g, flat_want[slot]):
            continue
        where = f"{name} slot {slot} (block {slot // block_size}, offset {slot % block_size})"
        if slot not in owner:
            for t in padding:
                for kind, x in rows.items():
                    if same(g, x[t]):
                        return (f"{where} holds padding token {t}'s {kind} row: a token with "
                                f"slot -1 must store nothing"
                                f"\n{where}에 패딩 토큰 {t}의 {kind} 행이 들어 있습니다: 슬롯이 "
                                "-1인 토큰은 아무것도 저장하면 안 됩니다")
            return (f"{where} belongs to no token and must stay NaN, but was written: a lane "
                    f"past kv_heads or head_dim not masked off, or an address off by some "
                    f"rows? Element (slot, h, d) lies at (slot * kv_heads + h) * head_dim + d"
                    f"\n{where}: 어느 토큰의 것도 아니어서 NaN으로 남아야 하는데 값이 쓰였습니다: "
                    "kv_heads나 head_dim을 넘는 레인을 마스킹하지 않았거나, 주소가 몇 행 "
                    "어긋났나요? 원소 (slot, h, d)는 (slot * kv_heads + h) * head_dim + d에 "
                    "있습니다")
        t = owner[slot]
        if g.isnan().all():
            return (f"{where} should hold token {t}'s row and was never written"
                    f"\n{where}: 토큰 {t}의 행이 들어 있어야 하는데 한 번도 쓰이지 않았습니다")
        for u in range(c.k.shape[0]):
            for kind, x in rows.items():
                if same(g, x[u]):
                    return (f"{where} should hold token {t}'s row, it holds token {u}'s {kind} "
                            f"row (each of k and v read with its own strides?)"
                            f"\n{where}: 토큰 {t}의 행이 들어 있어야 하는데 토큰 {u}의 {kind} "
                            "행이 들어 있습니다(k와 v를 각자의 stride로 읽었나요?)")
        heads, dims = g.isnan().nonzero(as_tuple=True)
        if heads.numel():
            return (f"{where} (token {t}) is only partly written: NaN left at head "
                    f"{int(heads[0])}, element {int(dims[0])} (of {pool.shape[2]} heads x "
                    f"{pool.shape[3]})"
                    f"\n{where} (토큰 {t}): 일부만 쓰였습니다. 헤드 {int(heads[0])}, 원소 "
                    f"{int(dims[0])}에 NaN이 남았습니다(전체: 헤드 {pool.shape[2]}개 x "
                    f"{pool.shape[3]})")
        return (f"{where} (token {t}) holds other numbers than token {t}'s row: are k's strides "
                f"used for the source rows?"
                f"\n{where} (토큰 {t}): 토큰 {t}의 행과 다른 수가 들어 있습니다: 원본 행을 읽을 "
                "때 k의 stride를 썼나요?")
    return None


def check(store, c: Case, slots=None):
    """Run store_kv on the case's pools and the twin on copies; fail with what differs."""
    slots = c.slots if slots is None else slots
    k_cache, v_cache = c.pools()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    store_kv_reference(c.k, c.v, k_want, v_want, slots)
    k_in, v_in = c.k.clone(), c.v.clone()
    result = store(c.k, c.v, k_cache, v_cache, slots)
    assert result is None, ("store_kv writes in place and returns None"
                            "\nstore_kv는 제자리에 쓰고 None을 돌려줍니다")
    assert torch.equal(c.k, k_in) and torch.equal(c.v, v_in), (
        "the kernel changed its inputs k, v"
        "\n커널이 입력 k, v를 바꿨습니다")
    for name, arena, want in (("k_cache", c.k_arena, k_want), ("v_cache", c.v_arena, v_want)):
        problem = explain(name, arena, want, c, slots)
        assert problem is None, f"{problem}\nslot_mapping: {slots.tolist()}"


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (2, 32), (3, 24)])
def test_matches_reference(store, block_size, kv_heads, head_dim):
    """3 heads of 24: a tile of 4 x 32 lanes, of which only 3 x 24 are real."""
    check(store, case(block_size * 100 + head_dim, block_size, kv_heads, head_dim))


def test_padding_rows_store_nothing(store):
    """Every token is padding: the pool must come back all NaN, whatever the rows hold."""
    c = case(1, 4, 2, 16, num_tokens=5, num_padding=5)
    assert (c.slots == -1).all()
    check(store, c)
    assert c.k_arena.isnan().all() and c.v_arena.isnan().all()


def test_rows_sliced_from_a_fused_qkv(store):
    """k and v are views of [T, 3, kv_heads, head_dim]: a token's rows are 3 rows apart."""
    c = case(2, 8, 2, 16, fused=True)
    assert not c.k.is_contiguous() and c.k.stride(0) == 3 * 2 * 16
    check(store, c)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_slot_dtypes(store, dtype):
    """The engine hands slots as int64, some callers as int32: both index the same rows."""
    c = case(3, 4, 2, 16)
    check(store, c, c.slots.to(dtype))


def test_block_edges(store):
    """The first slot, the last slot of a block and the first of the next, the pool's last."""
    c = case(4, 4, 2, 16, num_blocks=3, num_tokens=5)
    check(store, c, torch.tensor([0, 3, 4, -1, 11]))
