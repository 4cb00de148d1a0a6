"""The reference tier: plain PyTorch, one concept per file, read top to bottom.

It is the specification of behaviour: the optimized tier must produce what this tier produces.
Its subpackages show the architecture, and import one way only:

- ``ops``    the step's operations on tensors (attention over the paged cache, KV writes,
             block copies and swaps, norms, rotary, activation, sampling) — what kernels match;
- ``model``  the models, built from Hugging Face checkpoints, calling ops through a backend;
- ``kv``     KV memory: bookkeeping (block manager, prefix cache, slabs) apart from tensors;
- ``engine`` scheduler, step inputs, the step, sampling parameters, LLM — it uses all three;
- ``sim``    traces and a model-free simulator of allocation (the paper's waste figures).

The KV size calculator is a command of its own: ``python -m pagedllm.reference.kv_size``.
"""

from .engine import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    CompletionOutput,
    EngineArgs,
    LLMEngine,
    ModelRunner,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
    generate,
)
from .model import (
    SUPPORTED_MODEL_TYPES,
    ContiguousCache,
    ModelConfig,
    NoCache,
    load_config,
    load_model,
)

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "CompletionOutput", "ContiguousCache",
           "EngineArgs", "LLMEngine", "ModelConfig", "ModelRunner", "NoCache", "RequestOutput",
           "SUPPORTED_MODEL_TYPES", "SamplingParams", "StructuredOutputsParams", "generate",
           "load_config", "load_model"]
