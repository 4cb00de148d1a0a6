"""The KV cache's tensors, and the data moves the scheduler asked for.

Everything else in ``kv/`` is bookkeeping: which blocks a sequence holds, which to copy, which
to swap. This is the one place that owns memory: per layer a K and a V tensor of shape
[num_blocks, block_size, kv_heads, head_dim] on the device (the "GPU pool", whatever the
device), and the same shape on the CPU for swapped-out blocks. Latent attention (MLA) keeps
only the "K" tensors, [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]: one
latent row a slot. The model runner builds it from
the engine's ``KVCacheConfig`` and, before each forward, hands it the step's lists — blocks to
swap out, to swap in, to copy — and it carries them out with the backend's ops, in that order:
a block swapped out this step may be handed to another sequence, which may copy into it.

A slot is one token's row of K (and of V) in the flat view [num_blocks * block_size, kv_heads,
head_dim]: slot = block * block_size + offset. The contiguous layout uses the same storage with
blocks of one token, so a slab is a run of consecutive one-token blocks.

A pool with a sliding-window group has one more block on the device, the null block (see
``kv_cache_spec.py``): the placeholder block tables keep where the window gave a block back.
It is allocated zero-filled like every block, never written (no slot maps into it, no move
names it) and kept zero by ``fill_``, so any kernel that reads it reads finite zeros — which
the window's mask then weighs by zero.

A quantized pool (``kv_cache_dtype``, see ``ops/kv_quant.py``) stores its values in fewer bits.
int8 and int4 also keep a scale per slot and KV head (int4: a scale and a zero), in tensors of
the same block layout [num_blocks, block_size, kv_heads(, 2)]: every block move below moves
them too, so a swapped-in, copied or prefix-cached block keeps the scales its tokens were
written with. fp8's scales are one per layer for K and one for V, fixed once set, and never
move.
"""

import torch

from ..ops import REFERENCE_BACKEND, Backend
from ..ops.kv_quant import KVCacheQuant, hadamard, kv_cache_format
from .kv_cache_spec import KVCacheConfig


class CacheEngine:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: Backend = REFERENCE_BACKEND, kv_cache_dtype: str = "auto",
                 calculate_kv_scales: bool = False, null_block: int | None = None,
                 layer_tensors: tuple[int, ...] | None = None, values: bool = True):
        """num_layers: the K (and V) tensors to allocate; num_gpu_blocks: the device tensors'
        rows, the null block's included (null_block, its id, or None). layer_tensors: which
        tensor each model layer uses, where layers of several KV cache groups share them
        (``KVCacheConfig.tensor_of_layer``); None: layer i uses tensor i. values False:
        no V tensors (latent attention keeps one row a token, in the K tensors)."""
        fmt = kv_cache_format(kv_cache_dtype)
        if null_block is not None and not 0 <= null_block < num_gpu_blocks:
            raise ValueError(f"null_block {null_block} is not a block of the pool of "
                             f"{num_gpu_blocks}")
        self.null_block = null_block

        def pool(num_blocks: int, where, pin_memory: bool = False, scales: bool = False
                 ) -> list[torch.Tensor]:
            if scales:  # [num_blocks, block_size, kv_heads] (int4: [..., 2], scale and zero)
                shape = (num_blocks, block_size, num_kv_heads) + ((2,) if fmt.zero_point else ())
                of = fmt.scale_dtype
            else:
                shape = (num_blocks, block_size, num_kv_heads, fmt.storage_head_dim(head_dim))
                of = fmt.dtype_of(dtype)
            # zeros: the null block (if any) must read as finite zeros from the start
            return [torch.zeros(shape, dtype=of, device=where, pin_memory=pin_memory)
                    for _ in range(num_layers)]

        self.layer_tensors = layer_tensors or tuple(range(num_layers))
        self.block_size, self.backend, self.device = block_size, backend, torch.device(device)
        self.gpu_k = pool(num_gpu_blocks, device)
        self.gpu_v = pool(num_gpu_blocks, device) if values else []
        # Beside a CUDA pool, the swap space is pinned (page-locked) host memory: the GPU copies
        # to and from it by DMA, and a backend may queue those copies without waiting.
        pin = self.device.type == "cuda"
        self.cpu_k = pool(num_cpu_blocks, "cpu", pin)
        self.cpu_v = pool(num_cpu_blocks, "cpu", pin) if values else []
        # Tensors indexed by block: the values, and the scales of a per-token-head format.
        self.gpu_blocks, self.cpu_blocks = [(self.gpu_k, self.gpu_v)], [(self.cpu_k, self.cpu_v)]
        if fmt.scales == "per_token_head":
            gpu_scales = pool(num_gpu_blocks, device, scales=True), pool(num_gpu_blocks, device,
                                                                         scales=True)
            cpu_scales = (pool(num_cpu_blocks, "cpu", pin, scales=True),
                          pool(num_cpu_blocks, "cpu", pin, scales=True))
            self.gpu_blocks.append(gpu_scales)
            self.cpu_blocks.append(cpu_scales)
            rotation = hadamard(head_dim, device) if fmt.rotated else None
            self.quant = KVCacheQuant(fmt.name, *(self._per_layer(t) for t in gpu_scales),
                                      rotation=rotation)
        elif fmt.scales == "per_tensor":  # [1] float32 per layer: 1.0 until calculated
            def ones() -> list[torch.Tensor]:  # a layer's own, even where tensors are shared
                return [torch.ones(1, device=device) for _ in self.layer_tensors]
            self.quant = KVCacheQuant(fmt.name, ones(), ones(), calculate_kv_scales)
        else:
            self.quant = KVCacheQuant()

    def _per_layer(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The block-indexed tensors as the model's layers index them (shared ones repeat)."""
        return [tensors[t] for t in self.layer_tensors]

    @property
    def layer_k(self) -> list[torch.Tensor]:
        """Each model layer's K tensor (layers of different KV cache groups share them)."""
        return self._per_layer(self.gpu_k)

    @property
    def layer_v(self) -> list[torch.Tensor]:
        """Each model layer's V tensor; none where the pool keeps no V (latent attention)."""
        return self._per_layer(self.gpu_v) if self.gpu_v else []

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: KVCacheConfig, device: str | torch.device,
                             backend: Backend = REFERENCE_BACKEND,
                             calculate_kv_scales: bool = False) -> "CacheEngine":
        """The pool the engine decided on, with the heads of this rank's spec: the tensors
        above, indexed by block, one per layer of the largest KV cache group (every group's
        blocks are of one size: ``group_layers``)."""
        config = kv_cache_config
        spec = config.kv_cache_groups[0].kv_cache_spec
        layers = tuple(config.tensor_of_layer(i) for i in range(config.num_layers))
        return cls(config.num_kv_tensors, spec.num_kv_heads, spec.head_size, spec.block_size,
                   config.num_gpu_tensor_blocks, config.num_cpu_blocks, spec.dtype, device,
                   backend, spec.kv_cache_dtype, calculate_kv_scales, config.null_block,
                   layers, spec.stores_values)

    def nbytes(self) -> int:
        """Bytes of the device pool's blocks that hold tokens: values and scales. The null
        block, if any, is left out: one block of zeros beside the pool the engine sized."""
        def held(t: torch.Tensor) -> int:  # t: [rows, ...], the null block's row aside
            rows = t.shape[0]
            return t.nbytes // max(rows, 1) * (rows - (self.null_block is not None))
        return sum(held(t) for pair in self.gpu_blocks for caches in pair for t in caches) + \
            sum(t.nbytes for t in (*self.quant.k_scales, *self.quant.v_scales)
                if self.quant.scales_per_tensor)

    # --8<-- [start:apply]
    def apply(self, blocks_to_swap_out: list[tuple[int, int]],
              blocks_to_swap_in: list[tuple[int, int]],
              blocks_to_copy: list[tuple[int, int]]) -> None:
        """Carry out one step's data moves: (gpu, cpu) pairs out, (cpu, gpu) pairs in, then
        the copy-on-write (src, dst) pairs."""
        ops = self.backend

        def caches(pairs) -> list[torch.Tensor]:  # every block-indexed tensor, K's then V's
            return [cache for k, v in pairs for cache in (*k, *v)]

        if blocks_to_swap_out:
            pairs = torch.tensor(blocks_to_swap_out)  # [N, 2]
            for src, dst in zip(caches(self.gpu_blocks), caches(self.cpu_blocks),
                                strict=True):
                ops.swap_blocks(src, dst, pairs)
        if blocks_to_swap_in:
            pairs = torch.tensor(blocks_to_swap_in)  # [N, 2]
            for src, dst in zip(caches(self.cpu_blocks), caches(self.gpu_blocks),
                                strict=True):
                ops.swap_blocks(src, dst, pairs)
        if blocks_to_copy:
            pairs = torch.tensor(blocks_to_copy, device=self.device)  # [N, 2]
            for k_caches, v_caches in self.gpu_blocks:  # the values, then any scales
                ops.copy_blocks(k_caches, v_caches, pairs)
    # --8<-- [end:apply]

    def fill_(self, value: float) -> None:
        """Overwrite every slot of the device pool (tests poison unused slots with NaN), except
        the null block's, which stays zero: a kernel may read it, and the window's mask can
        discard a zero but not a NaN (0 x NaN is NaN). An integer pool cannot hold NaN: its
        values get the largest integer, its scales the value."""
        for k_caches, v_caches in self.gpu_blocks:
            for cache in (*k_caches, *v_caches):
                cache.fill_(value if cache.is_floating_point() else torch.iinfo(cache.dtype).max)
                if self.null_block is not None:
                    cache[self.null_block].zero_()
