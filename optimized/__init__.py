"""The optimized tier: the reference engine's behaviour, fast.

Same API as ``pagedllm.reference`` (``LLM``, ``LLMEngine``, ``SamplingParams``,
``BeamSearchParams``) and the same results. There is one engine (``LLMEngine`` is the
reference's): scheduler, KV cache manager, step inputs, sampling parameters, stop checks and
outputs. This tier is a model runner (``model_runner.py``): merged projections (``layers.py``),
one backend per device chosen when the runner is built (``backend.py``: the Triton kernels and
CUDA graphs on a GPU; the C++ kernels for AVX-512, AVX2 or any CPU, and the decode step in one
call, on a CPU), persistent step buffers, and vLLM's profiled KV pool sizing on CUDA
(``kv_sizing.py``).
``LLM`` and ``EngineArgs`` choose it. Paged layout and continuous batching only: the contiguous
and static baselines are the reference tier's.
"""

from pagedllm.reference.engine.beam_search import BeamSearchParams
from pagedllm.reference.engine.engine import LLMEngine
from pagedllm.reference.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams

from .backend import CPU_BACKEND, TRITON_BACKEND, select_backend
from .llm import LLM, EngineArgs
from .model_runner import ModelRunner

__all__ = ["CPU_BACKEND", "TRITON_BACKEND", "BeamSearchParams", "CompletionOutput", "EngineArgs",
           "LLM", "LLMEngine", "ModelRunner", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "select_backend"]
