"""copy_blocks: every copy-on-write copy of one step, in every layer, K and V, in one launch.

When a sequence that shares a block with another (parallel sampling, beam search, a shared
prefix) writes into it, the block manager gives it a fresh block and asks for a copy:
``block_mapping`` [N, 2] lists the step's (src, dst) block pairs. The same copy must happen in
every layer's K cache and V cache: N * 2 * num_layers block copies.

The torch twin (``pagedllm.reference.ops.copy_blocks``) runs one gather-and-scatter per cache:
2 * num_layers launches, each tiny. This kernel does them all in one launch, the way vLLM's
copy_blocks does: it receives a table of the caches' base addresses (int64) and the program
(pair, cache, chunk) turns its table entry back into a pointer and copies one chunk of one
block. Each element is read once and written once, and the launch overhead is paid once.

How the pointer table works under the interpreter, honestly: the table holds raw addresses,
which is exactly what a GPU kernel wants. Triton's interpreter hands a kernel the CPU memory of
its CPU tensor arguments unchanged (no copies) and dereferences pointers as host addresses, so
a table of CPU tensors' addresses works there too: CI runs this one-launch path. What cannot
work is the interpreter with CUDA tensors: it copies each *argument* to the host, and a device
address inside the table would be dereferenced on the host. That case (and caches that differ
in dtype or block size) falls back to one launch per cache of the same kernel, with the cache
passed as an ordinary argument (``USE_TABLE=False``).

Assumption, as in vLLM: within one step no block is both a source and a destination, and no
destination repeats (the block manager copies from a shared block into a freshly allocated
one), so the copies are independent and may run in any order.
"""

import functools

import torch
import triton
import triton.language as tl

from pagedllm.reference.ops import copy_blocks as copy_blocks_reference

from .runtime import interpreting, kernel_runner


# --8<-- [start:kernel]
@triton.jit
def _copy_blocks_kernel(
    table_ptr,                # [num_caches] int64 base addresses (read when USE_TABLE)
    cache_ptr,                # the first cache: its element type types every table entry
    mapping_ptr,              # [N, 2] (src, dst) block ids, rows contiguous
    block_numel,              # elements in one block: block_size * kv_heads * head_dim
    USE_TABLE: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    which = tl.program_id(1)  # which cache: K of layer 0..L-1, then V of layer 0..L-1
    chunk = tl.program_id(2)  # which CHUNK-element piece of the block
    if USE_TABLE:
        # An int64 address back to a typed pointer: the one place layers differ.
        base = tl.load(table_ptr + which).to(tl.pointer_type(cache_ptr.dtype.element_ty))
    else:
        base = cache_ptr
    # int64: block id * block size passes 2**31 elements in a big cache.
    src = tl.load(mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offs < block_numel
    # A plain copy, no arithmetic: the bits of any dtype arrive unchanged.
    values = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, values, mask=mask)
# --8<-- [end:kernel]


@functools.lru_cache(maxsize=16)
def _address_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The caches' base addresses as an int64 tensor on their device. Cached: the engine's
    caches live as long as the engine, so a step after the first builds no table (on CUDA
    that saves a host-to-device copy per step). Keyed by the addresses themselves, an entry
    can never be stale."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)  # [num_caches]


def _one_launch_possible(caches: list[torch.Tensor]) -> bool:
    """Can one launch cover every cache through the address table?"""
    first = caches[0]
    if interpreting() and first.is_cuda:
        return False  # the interpreter would read device addresses on the host
    return all(c.dtype == first.dtype and c[0].numel() == first[0].numel() for c in caches)


# --8<-- [start:launcher]
def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Triton version of ``pagedllm.reference.ops.copy_blocks``, same arguments, same effect.

    k_caches, v_caches: one contiguous [num_blocks, block_size, kv_heads, head_dim] tensor per
    layer; block_mapping [N, 2] (src, dst) on the caches' device. Block ids are not checked
    against the cache size, and no block may be both a source and a destination in one call.
    """
    runner = kernel_runner(_copy_blocks_kernel, *k_caches, *v_caches, block_mapping)
    if runner is None:
        return copy_blocks_reference(k_caches, v_caches, block_mapping)
    caches = [*k_caches, *v_caches]
    # A byte copy needs no fp8 type, and Triton cannot even load e4m3 on sm_80: fp8 pools move
    # as their bytes (uint8).
    caches = [c.view(torch.uint8) if c.is_floating_point() and c.element_size() == 1 else c
              for c in caches]
    if block_mapping.numel() == 0 or not caches:
        return None
    if not all(c.is_contiguous() for c in caches):
        raise ValueError("copy_blocks's kernel needs contiguous caches")
    block_mapping = block_mapping.contiguous()  # [N, 2]
    num_pairs = block_mapping.shape[0]

    def chunk_size(cache: torch.Tensor) -> int:
        # Up to 4096 elements per program: a whole block of a small cache, a quarter of a
        # 16-token x 8-head x 128-dim block, so big blocks still spread over many programs.
        return min(triton.next_power_of_2(cache[0].numel()), 4096)

    if _one_launch_possible(caches):
        first = caches[0]
        table = _address_table(tuple(c.data_ptr() for c in caches), first.device)
        block_numel, chunk = first[0].numel(), chunk_size(first)
        grid = (num_pairs, len(caches), triton.cdiv(block_numel, chunk))
        runner[grid](table, first, block_mapping, block_numel, USE_TABLE=True, CHUNK=chunk)
        return None
    for cache in caches:  # the fallback: one launch per cache, the cache as an argument
        block_numel, chunk = cache[0].numel(), chunk_size(cache)
        grid = (num_pairs, 1, triton.cdiv(block_numel, chunk))
        runner[grid](block_mapping, cache, block_mapping, block_numel, USE_TABLE=False,
                     CHUNK=chunk)
    return None
# --8<-- [end:launcher]
