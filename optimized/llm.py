"""LLM and EngineArgs for the optimized tier: the one engine, with this tier's model runner and
ops chosen by default. Everything else — the checks, the KV sizing, the tokenizer, the request
loop — is the reference's. Two options matter here only, as vLLM names them:

- ``enforce_eager=True`` turns the backend's whole-step slot off (CUDA graphs; on a CPU the
  decode step in one C++ call, ``decode_step.py``): every step runs the modules;
- ``gpu_memory_utilization`` (default 0.9): on CUDA, when neither ``num_gpu_blocks`` nor
  ``kv_cache_memory`` is given, the share of the GPU's memory the engine may fill — the KV pool
  gets what the weights and a profiled step's activations leave of it.
"""

from dataclasses import dataclass

from pagedllm.reference.engine.config import EngineArgs as ReferenceEngineArgs
from pagedllm.reference.engine.llm import LLM as ReferenceLLM
from pagedllm.reference.engine.llm import signature_of
from pagedllm.reference.ops import Backend

from .model_runner import ModelRunner


@dataclass
class EngineArgs(ReferenceEngineArgs):
    """The reference's EngineArgs, this tier's runner by default, and its backend chosen for
    the device when the runner is built (backend=None: ``backend.select_backend``)."""

    backend: Backend | None = None
    model_runner: type = ModelRunner


class LLM(ReferenceLLM):
    """``pagedllm.reference.LLM`` on the optimized model runner: same options, same results."""

    def __init__(self, model, *args, **options):
        if isinstance(model, ReferenceEngineArgs):  # a whole EngineArgs, as the reference's
            super().__init__(model, *args, **options)
        else:
            super().__init__(EngineArgs(model, *args, **options))


LLM.__init__.__signature__ = signature_of(EngineArgs)
