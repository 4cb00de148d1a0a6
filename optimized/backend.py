"""The optimized tier's ops: the Triton kernels, and asynchronous swapping.

Every launcher in ``kernels/`` runs its kernel on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``) and its torch twin otherwise. The twins of the small ops are already
vectorized; the twin of paged attention loops over prompts, so on a plain CPU the model runner
attends through ``attention.PlannedAttention`` instead of this bundle's attention op (it decides
so once, when it is built). Swapping is a copy, not a kernel; on CUDA this tier queues it
without waiting (``swap_blocks`` below).
"""

from dataclasses import replace

import torch

from pagedllm.kernels.backend import TRITON_BACKEND
from pagedllm.reference.ops import swap_blocks as swap_blocks_reference


# --8<-- [start:swap_blocks]
def swap_blocks(src: torch.Tensor, dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """The twin's result (reference/ops/cache_ops.py). Between a CUDA pool and a pinned
    CPU pool it queues one asynchronous copy per block, as vLLM's swap_blocks does (a
    cudaMemcpyAsync per block): the host goes on to the forward while the bus moves the
    blocks.

    Waiting is never needed, because the copies sit on the current stream. The forward
    that overwrites a swapped-out block is queued after the copy reading it, and a
    swap-in's copy before the forward reading its blocks. Only pinned (page-locked) host
    memory can take part in an asynchronous copy; from pageable memory CUDA copies
    synchronously.
    """
    cpu = dst if src.is_cuda else src
    if src.device == dst.device or not cpu.is_pinned():
        return swap_blocks_reference(src, dst, block_mapping)
    for s, d in block_mapping.tolist():
        # one block: [block_size, kv_heads, head_dim]
        dst[d].copy_(src[s], non_blocking=True)
# --8<-- [end:swap_blocks]


# --8<-- [start:backend]
OPTIMIZED_BACKEND = replace(TRITON_BACKEND, swap_blocks=swap_blocks)
# --8<-- [end:backend]
