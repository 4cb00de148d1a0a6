"""store_kv and copy_blocks kernels against their torch twins, on the CPU through Triton's
interpreter.

Both ops only move data, so the comparison is exact (tolerance 0, NaN == NaN): a kernel that
computed anything on the way (a float conversion, a wrong row) would show. Every slot the op
must leave alone is NaN before the launch and must still be NaN afterwards: the padding rows of
store_kv (slot -1) must not land anywhere, and copy_blocks must touch only its destination
blocks. Rows the op must write start as NaN too, so a forgotten row shows.

The interpreter runs one program at a time in numpy: the shapes are small.
"""

import zlib

import pytest
import torch

from pagedllm.kernels import copy_blocks as copy_blocks_module
from pagedllm.kernels import store_kv as store_kv_module
from pagedllm.kernels.copy_blocks import copy_blocks
from pagedllm.kernels.store_kv import store_kv
from pagedllm.reference.ops import copy_blocks as copy_blocks_reference
from pagedllm.reference.ops import store_kv as store_kv_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernel_runner reads it at every launch


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded by the test's id: fresh inputs per parametrization, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


class Boom:
    """Stands in for a kernel that must not run: any launch fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("the kernel ran")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the kernel ran")


# ----------------------------------------------------------------------------------------------
# store_kv


def store_kv_case(gen, block_size, kv_heads, head_dim, dtype=torch.float32, num_blocks=5,
                  num_tokens=11, num_padding=3, strided=False):
    """k, v [T, kv_heads, head_dim], NaN caches, and slot_mapping [T] with -1 padding rows."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # distinct
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    shape = (num_tokens, kv_heads, head_dim)
    if strided:
        # k and v as views into a fused [T, q | k | v] projection output: row stride != row size.
        fused = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=gen).to(dtype)
        k, v = fused[:, 1], fused[:, 2]
    else:
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    return k, v, k_cache, v_cache, slots


def check_store_kv(k, v, k_cache, v_cache, slots):
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, k_expected, v_expected, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    same(k_cache, k_expected)
    same(v_cache, v_expected)
    # The twin agrees, but check the contract directly too: kept rows are k/v, exactly, and
    # every other slot (never written, or a padding row's) is still NaN.
    keep = slots >= 0
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, kv_heads, hd]
    same(flat_k[slots[keep]], k[keep])
    same(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("kv_heads", [1, 3, 8])  # MQA, GQA's; 3 leaves part of the tile masked
def test_store_kv_matches_twin(gen, block_size, head_dim, kv_heads):
    check_store_kv(*store_kv_case(gen, block_size, kv_heads, head_dim))


def test_store_kv_several_head_tiles(gen):
    """24 heads of 128: two tiles of 16 heads per token, the second half masked."""
    check_store_kv(*store_kv_case(gen, 8, 24, 128, num_blocks=2, num_tokens=4, num_padding=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_dtypes_copy_bits(gen, dtype):
    check_store_kv(*store_kv_case(gen, 16, 4, 96, dtype=dtype))


def test_store_kv_strided_rows(gen):
    """k and v sliced out of a fused QKV output are written without a copy to contiguous."""
    k, v, k_cache, v_cache, slots = store_kv_case(gen, 8, 2, 64, strided=True)
    assert not k.is_contiguous()
    check_store_kv(k, v, k_cache, v_cache, slots)


def test_store_kv_all_padding_writes_nothing(gen):
    k, v, k_cache, v_cache, slots = store_kv_case(gen, 8, 2, 64, num_tokens=4, num_padding=4)
    assert (slots == -1).all()
    store_kv(k, v, k_cache, v_cache, slots)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_store_kv_int32_slots(gen):
    k, v, k_cache, v_cache, slots = store_kv_case(gen, 16, 2, 64)
    check_store_kv(k, v, k_cache, v_cache, slots.to(torch.int32))


def test_store_kv_falls_back_to_twin_without_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(store_kv_module, "_store_kv_kernel", Boom())
    check_store_kv(*store_kv_case(gen, 8, 2, 64))


# ----------------------------------------------------------------------------------------------
# copy_blocks


def copy_blocks_case(gen, block_size, kv_heads, head_dim, num_layers=2, dtype=torch.float32,
                     num_blocks=8, num_pairs=3):
    """Per layer a K and a V cache whose blocks are random (in use) or NaN (free), and
    block_mapping [num_pairs, 2]: (src, dst) from in-use blocks to distinct free ones."""
    order = torch.randperm(num_blocks, generator=gen)
    used, free = order[: num_blocks // 2], order[num_blocks // 2:]
    src = used[torch.randint(len(used), (num_pairs,), generator=gen)]  # may repeat: one block
    dst = free[:num_pairs]  # forked into several copies, as parallel sampling does
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def cache():
        c = torch.full(shape, float("nan"))
        c[used] = torch.randn(len(used), *shape[1:], generator=gen)
        return c.to(dtype)

    k_caches = [cache() for _ in range(num_layers)]
    v_caches = [cache() for _ in range(num_layers)]
    return k_caches, v_caches, torch.stack([src, dst], dim=1)  # [num_pairs, 2]


def check_copy_blocks(k_caches, v_caches, mapping):
    k_expected = [c.clone() for c in k_caches]
    v_expected = [c.clone() for c in v_caches]
    copy_blocks_reference(k_expected, v_expected, mapping)
    before = [c.clone() for c in (*k_caches, *v_caches)]
    copy_blocks(k_caches, v_caches, mapping)
    src, dst = mapping[:, 0], mapping[:, 1]
    others = torch.ones(k_caches[0].shape[0], dtype=torch.bool)
    others[dst] = False
    for actual, expected, old in zip((*k_caches, *v_caches), (*k_expected, *v_expected), before,
                                     strict=True):
        same(actual, expected)
        same(actual[dst], old[src])  # each destination is its source, bit for bit
        same(actual[others], old[others])  # every other block, used or free (NaN), untouched


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_copy_blocks_matches_twin(gen, block_size, head_dim):
    check_copy_blocks(*copy_blocks_case(gen, block_size, 2, head_dim))


@pytest.mark.parametrize("kv_heads", [1, 4, 8])
def test_copy_blocks_kv_heads(gen, kv_heads):
    check_copy_blocks(*copy_blocks_case(gen, 8, kv_heads, 64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_dtypes_copy_bits(gen, dtype):
    check_copy_blocks(*copy_blocks_case(gen, 16, 2, 80, dtype=dtype))


def count_launches(monkeypatch, module) -> list:
    """Wrap the module's kernel_runner so that every launch is recorded (grid per launch)."""
    launches = []
    real = module.kernel_runner

    def counting_runner(kernel, *tensors):
        runner = real(kernel, *tensors)

        class Counting:
            def __getitem__(self, grid):
                launches.append(grid)
                return runner[grid]

        return None if runner is None else Counting()

    monkeypatch.setattr(module, "kernel_runner", counting_runner)
    return launches


def test_copy_blocks_is_one_launch_for_all_layers(gen, monkeypatch):
    launches = count_launches(monkeypatch, copy_blocks_module)
    k_caches, v_caches, mapping = copy_blocks_case(gen, 8, 2, 64, num_layers=4)
    check_copy_blocks(k_caches, v_caches, mapping)
    assert len(launches) == 1
    assert launches[0][:2] == (3, 8)  # (pairs, 2 * layers)


def test_copy_blocks_layers_as_views_of_one_tensor(gen):
    """Caches that are slices of one stacked [2, L, ...] allocation work the same way."""
    k_caches, v_caches, mapping = copy_blocks_case(gen, 8, 2, 64)
    stacked = torch.stack([torch.stack(k_caches), torch.stack(v_caches)])  # [2, L, blocks, ...]
    check_copy_blocks(list(stacked[0]), list(stacked[1]), mapping)


def test_copy_blocks_one_launch_per_cache_path(gen, monkeypatch):
    """The fallback used for CUDA tensors under the interpreter (device addresses cannot be
    dereferenced there): same result, one launch per cache."""
    monkeypatch.setattr(copy_blocks_module, "_one_launch_possible", lambda caches: False)
    launches = count_launches(monkeypatch, copy_blocks_module)
    check_copy_blocks(*copy_blocks_case(gen, 8, 2, 64))
    assert len(launches) == 4


def test_copy_blocks_mixed_dtypes_take_one_launch_per_cache(gen, monkeypatch):
    launches = count_launches(monkeypatch, copy_blocks_module)
    k_caches, v_caches, mapping = copy_blocks_case(gen, 8, 2, 64)
    v_caches = [c.to(torch.float16) for c in v_caches]
    check_copy_blocks(k_caches, v_caches, mapping)
    assert len(launches) == 4


def test_copy_blocks_empty_mapping_is_a_no_op(gen, monkeypatch):
    launches = count_launches(monkeypatch, copy_blocks_module)
    k_caches, v_caches, _ = copy_blocks_case(gen, 8, 2, 64, num_layers=1)
    before = [c.clone() for c in (*k_caches, *v_caches)]
    copy_blocks(k_caches, v_caches, torch.empty(0, 2, dtype=torch.int64))
    assert launches == []
    for actual, old in zip((*k_caches, *v_caches), before, strict=True):
        same(actual, old)


def test_copy_blocks_falls_back_to_twin_without_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(copy_blocks_module, "_copy_blocks_kernel", Boom())
    check_copy_blocks(*copy_blocks_case(gen, 8, 2, 64))
