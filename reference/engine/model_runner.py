"""The model runner: the seam between the engine and model execution (vLLM's GPUModelRunner).

The engine orders the step: the scheduler schedules and, after the forward, updates
(``Scheduler.update_from_output``); ``prepare_inputs`` builds each step's ``StepInputs``. The
runner holds the model and the KV tensors and runs it: it says what its layers
cache (``get_kv_cache_spec``), allocates the pool the engine sized (``initialize_kv_cache``),
carries out the step's block moves (``move_blocks``) and runs the forward
(``execute(step_inputs) -> logits``). This is the
one place a tier differs. The reference runner below is the readable model, called with the
reference's attention context; ``pagedllm.optimized`` has a runner of its own (merged
projections, persistent buffers, CUDA graphs, profiled KV sizing, attention planned once per
step) behind the same methods, plus ``profile_num_blocks()`` where ``profiles_kv_cache``. The
engine picks the runner class once, from its config (``EngineArgs.model_runner``), and never
asks which one it has.

What a runner can and cannot do is said by three class attributes, which the configuration's
checks read (``config.py``), so that a tier refuses what it does not run at the door.
"""

import torch

from ..kv import (
    CacheEngine,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_layers,
)
from ..model import KVCacheQuant, PagedAttention
from ..model.tensor_parallel import all_reduce_max, attention_heads
from ..ops import REFERENCE_BACKEND, Backend, SamplerOutput, SamplingMetadata
from .step_inputs import StepInputs


class ModelRunner:
    tier = "reference"
    runs_baselines = True  # the contiguous-slab and static-batching baselines
    profiles_kv_cache = False  # sizes the KV pool by a profiling step (gpu_memory_utilization)
    captures_graphs = False  # CUDA graphs, or a CPU decode stack (enforce_eager turns them off)

    def __init__(self, model: torch.nn.Module, config, rank: int = 0) -> None:
        """config: the EngineConfig (backend, budgets, block size) the engine was built from;
        rank: which tensor-parallel rank's shard `model` is (its KV heads)."""
        self.config, self.rank = config, rank
        self.backend: Backend = self.choose_backend(config, next(model.parameters()).device)
        # the linear layers as the backend's products (the reference's: kept as they are)
        self.model = self.backend.process_weights(model, config.dtype)
        self.cache_engine: CacheEngine | None = None  # initialize_kv_cache builds it
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.kv_quant = KVCacheQuant()

    def choose_backend(self, config, device: torch.device) -> Backend:
        """The ops this runner computes with: the engine's (EngineArgs.backend), or this
        tier's own where it was given none."""
        return REFERENCE_BACKEND if config.backend is None else config.backend

    def kernels(self) -> dict[str, str]:
        """What computes each op of a step, and why (``LLM.kernels()``)."""
        if self.backend is REFERENCE_BACKEND:
            return {"every op": "its torch definition in reference/ops (the reference tier: "
                                "readable, and the twin every kernel is tested against)"}
        return {"every op": f"backend {self.backend.name!r} as the engine was handed it"}

    # --8<-- [start:kv_cache]
    def get_kv_cache_spec(self, block_size: int) -> tuple[KVCacheGroupSpec, ...]:
        """What this runner's layers cache, for blocks of block_size tokens, with this rank's
        KV heads (vLLM's ``get_kv_cache_spec``): per layer, a sliding window where the layer
        slides (its blocks out of the window go back to the pool), else full attention; the
        layers grouped by kind (``group_layers``): one group when every layer is of one kind
        (Llama: full; Mistral: one window; DeepSeek-V2: latent), several for a model that
        mixes them (Gemma 3)."""
        cfg, config = self.config.model_config, self.config
        if cfg.is_mla:  # one latent row a token and layer, shared by every head
            width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            spec = MLAAttentionSpec(block_size, 1, width, config.dtype, config.kv_cache_dtype)
            return group_layers([spec] * cfg.num_layers)
        heads = attention_heads(cfg, self.rank, config.tensor_parallel_size)[1]
        shape = (block_size, len(heads), cfg.head_dim, config.dtype, config.kv_cache_dtype)
        windows = cfg.sliding_windows or (None,) * cfg.num_layers  # None: full attention
        return group_layers([FullAttentionSpec(*shape) if w is None
                             else SlidingWindowSpec(*shape, sliding_window=w) for w in windows])

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV pool the engine decided on (K and V tensors, shared by one layer of
        every KV cache group, on this runner's device, and the CPU swap space) and how it is
        quantized; each layer is handed its tensors and, every step, its group's metadata."""
        device = next(self.model.parameters()).device
        self.cache_engine = CacheEngine.from_kv_cache_config(
            kv_cache_config, device, self.backend, self.config.calculate_kv_scales)
        self.k_caches, self.v_caches = self.cache_engine.layer_k, self.cache_engine.layer_v
        self.kv_quant = self.cache_engine.quant
        self.layer_groups = [kv_cache_config.group_of_layer(layer)
                             for layer in range(kv_cache_config.num_layers)]
        if self.config.tensor_parallel_size > 1:  # fp8 calibrates over every rank's heads
            self.kv_quant.reduce_max = all_reduce_max
    # --8<-- [end:kv_cache]

    def layer_metadata(self, inputs: StepInputs) -> list | None:
        """Each layer's attention metadata where the model has several KV cache groups (its
        group's block tables and slots); None where every layer reads inputs.attn_metadata."""
        if not inputs.kv_group_metadata:
            return None
        groups = (inputs.attn_metadata, *inputs.kv_group_metadata)
        return [groups[g] for g in self.layer_groups]

    def move_blocks(self, blocks_to_swap_out: list[tuple[int, int]],
                    blocks_to_swap_in: list[tuple[int, int]],
                    blocks_to_copy: list[tuple[int, int]]) -> None:
        """Carry out the scheduler's block moves on the pool, before the step's forward (a
        tensor-parallel runner also has every rank do them on its own pool)."""
        self.cache_engine.apply(blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """logits [S, vocab] for the step's logits_indices rows. fp8 with calculate_kv_scales
        takes its scales from the first forward: once one has finished, they stay (a failed
        forward leaves the flag set, so no layer keeps a scale of a batch thrown away)."""
        logits = self.forward(inputs)
        self.kv_quant.calculate_scales = False
        return logits

    # --8<-- [start:execute]
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """One forward over every scheduled token of every sequence, laid flat."""
        context = self.backend.attention_context or PagedAttention
        attn = context(inputs.attn_metadata, self.k_caches, self.v_caches, self.backend,
                       self.kv_quant, self.layer_metadata(inputs))
        return self.model(inputs.input_ids, inputs.positions, attn,
                          logits_indices=inputs.logits_indices)  # [S, vocab]
    # --8<-- [end:execute]

    def sample(self, logits: torch.Tensor, sampling: SamplingMetadata) -> SamplerOutput:
        """One token per logits row (the backend's sampler: the reference's or a kernel)."""
        return self.backend.sample(logits, sampling)

    def check_health(self) -> None:
        """One process, nothing to lose: a tensor-parallel runner checks its ranks here."""

    def shutdown(self) -> None:
        """Nothing was started: a tensor-parallel runner ends its ranks here."""
