"""The optimized tier: the reference engine's behaviour, fast.

Same API as ``pagedllm.reference`` (``LLM``, ``LLMEngine``, ``SamplingParams``,
``BeamSearchParams``) and the same results. It reuses the reference's scheduler, KV cache
manager, step inputs, sampling parameters, stop checks and outputs, and replaces model execution:
merged projections (``layers.py``), the Triton kernels or a vectorized CPU path (``backend.py``,
``attention.py``), persistent step buffers and CUDA graphs (``model_runner.py``), and vLLM's
profiled KV pool sizing on CUDA (``engine.py``). Paged layout and continuous batching only: the
contiguous and static baselines are the reference tier's.
"""

from pagedllm.reference.engine.beam_search import BeamSearchParams
from pagedllm.reference.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.reference.engine.sampling_params import SamplingParams

from .backend import OPTIMIZED_BACKEND
from .engine import LLMEngine
from .llm import LLM

__all__ = ["OPTIMIZED_BACKEND", "BeamSearchParams", "CompletionOutput", "LLM", "LLMEngine",
           "RequestOutput", "SamplingParams"]
