"""The model runner: the seam between the engine and model execution (vLLM's GPUModelRunner).

The engine schedules, keeps the KV bookkeeping, builds each step's ``StepInputs``, samples and
updates. The runner holds the model and runs it: ``execute(step_inputs) -> logits``. This is the
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

from ..kv import CacheEngine
from ..model import KVCacheQuant, PagedAttention
from ..ops import Backend, SamplerOutput, SamplingMetadata
from .step_inputs import StepInputs


class ModelRunner:
    tier = "reference"
    runs_baselines = True  # the contiguous-slab and static-batching baselines
    profiles_kv_cache = False  # sizes the KV pool by a profiling step (gpu_memory_utilization)
    captures_graphs = False  # CUDA graphs, or a CPU decode stack (enforce_eager turns them off)

    def __init__(self, model: torch.nn.Module, config) -> None:
        """config: the EngineConfig (backend, budgets, block size) the engine was built from."""
        self.model = model
        self.backend: Backend = config.backend
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.kv_quant = KVCacheQuant()

    def bind_kv_cache(self, cache_engine: CacheEngine) -> None:
        """The KV pool (one K and one V tensor per layer, allocated by the cache engine) and how
        it is quantized (its scales)."""
        self.cache_engine = cache_engine
        self.k_caches, self.v_caches = cache_engine.gpu_k, cache_engine.gpu_v
        self.kv_quant = cache_engine.quant

    def move_blocks(self, blocks_to_swap_out: list[tuple[int, int]],
                    blocks_to_swap_in: list[tuple[int, int]],
                    blocks_to_copy: list[tuple[int, int]]) -> None:
        """Carry out the scheduler's block moves on the pool, before the step's forward (a
        tensor-parallel runner also has every rank do them on its own pool)."""
        self.cache_engine.apply(blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy)

    # --8<-- [start:execute]
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """One forward over every scheduled token of every sequence, laid flat."""
        attn = PagedAttention(inputs.attn_metadata, self.k_caches, self.v_caches,
                              self.backend, self.kv_quant)
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
