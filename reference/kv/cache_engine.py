"""The KV cache's tensors, and the data moves the scheduler asked for.

Everything else in ``kv/`` is bookkeeping: which blocks a sequence holds, which to copy, which
to swap. This is the one place that owns memory: per layer a K and a V tensor of shape
[num_blocks, block_size, kv_heads, head_dim] on the device (the "GPU pool", whatever the
device), and the same shape on the CPU for swapped-out blocks. Before each forward the engine
hands it the step's lists — blocks to swap out, to swap in, to copy — and it carries them out
with the backend's ops, in that order: a block swapped out this step may be handed to another
sequence, which may copy into it.

A slot is one token's row of K (and of V) in the flat view [num_blocks * block_size, kv_heads,
head_dim]: slot = block * block_size + offset. The contiguous layout uses the same storage with
blocks of one token, so a slab is a run of consecutive one-token blocks.
"""

import torch

from ..ops import REFERENCE_BACKEND, Backend


class CacheEngine:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: Backend = REFERENCE_BACKEND):
        def pool(num_blocks: int, where, pin_memory: bool = False) -> list[torch.Tensor]:
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            return [torch.zeros(shape, dtype=dtype, device=where, pin_memory=pin_memory)
                    for _ in range(num_layers)]

        self.block_size, self.backend, self.device = block_size, backend, torch.device(device)
        self.gpu_k, self.gpu_v = pool(num_gpu_blocks, device), pool(num_gpu_blocks, device)
        # Beside a CUDA pool, the swap space is pinned (page-locked) host memory: the GPU copies
        # to and from it by DMA, and a backend may queue those copies without waiting.
        pin = self.device.type == "cuda"
        self.cpu_k, self.cpu_v = pool(num_cpu_blocks, "cpu", pin), pool(num_cpu_blocks, "cpu", pin)

    # --8<-- [start:apply]
    def apply(self, blocks_to_swap_out: list[tuple[int, int]],
              blocks_to_swap_in: list[tuple[int, int]],
              blocks_to_copy: list[tuple[int, int]]) -> None:
        """Carry out one step's data moves: (gpu, cpu) pairs out, (cpu, gpu) pairs in, then
        the copy-on-write (src, dst) pairs."""
        ops = self.backend
        if blocks_to_swap_out:
            pairs = torch.tensor(blocks_to_swap_out)  # [N, 2]
            for src, dst in zip((*self.gpu_k, *self.gpu_v), (*self.cpu_k, *self.cpu_v),
                                strict=True):
                ops.swap_blocks(src, dst, pairs)
        if blocks_to_swap_in:
            pairs = torch.tensor(blocks_to_swap_in)  # [N, 2]
            for src, dst in zip((*self.cpu_k, *self.cpu_v), (*self.gpu_k, *self.gpu_v),
                                strict=True):
                ops.swap_blocks(src, dst, pairs)
        if blocks_to_copy:
            ops.copy_blocks(self.gpu_k, self.gpu_v,
                            torch.tensor(blocks_to_copy, device=self.device))  # [N, 2]
    # --8<-- [end:apply]

    def fill_(self, value: float) -> None:
        """Overwrite every slot of the device pool (tests poison unused slots with NaN)."""
        for cache in (*self.gpu_k, *self.gpu_v):
            cache.fill_(value)
