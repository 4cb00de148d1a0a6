"""LLM for the optimized tier: the reference's LLM (checks, KV sizing, tokenizer, request loop)
with the optimized engine, and two options of its own, as vLLM names them:

- ``enforce_eager=True`` turns CUDA graphs off;
- ``gpu_memory_utilization`` (default 0.9): on CUDA, when neither ``num_gpu_blocks`` nor
  ``kv_cache_memory`` is given, the share of the GPU's memory the engine may fill — the KV pool
  gets what the weights and a profiled step's activations leave of it.
"""

import inspect

from pagedllm.reference.engine.llm import LLM as ReferenceLLM
from pagedllm.reference.engine.validation import check_float

from .backend import OPTIMIZED_BACKEND
from .engine import LLMEngine


class LLM(ReferenceLLM):
    engine_class = LLMEngine

    def __init__(self, model, *args, backend=OPTIMIZED_BACKEND, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.9, **kwargs):
        # Checked on every device, though only CUDA uses it: a typo must not pass on a laptop
        # and fail on the server.
        check_float("gpu_memory_utilization", gpu_memory_utilization, low=0.0, high=1.0,
                    low_open=True)
        given = inspect.signature(ReferenceLLM.__init__).bind(self, model, *args, **kwargs)
        sized = any(given.arguments.get(name) is not None
                    for name in ("num_gpu_blocks", "kv_cache_memory"))
        self._engine_options = {
            "enforce_eager": enforce_eager,
            "gpu_memory_utilization": None if sized else gpu_memory_utilization}
        super().__init__(model, *args, backend=backend, **kwargs)

    def engine_options(self) -> dict:
        return self._engine_options
