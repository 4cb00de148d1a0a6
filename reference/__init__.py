"""The reference tier: plain PyTorch, one concept per file, read top to bottom.

It is the specification of behaviour: the optimized tier must produce what this tier produces.
The KV size calculator is a command of its own: ``python -m pagedllm.reference.kv_size``.
"""

from .cache import ContiguousCache, NoCache
from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .generate import generate
from .model import load_model

__all__ = ["ContiguousCache", "ModelConfig", "NoCache", "SUPPORTED_MODEL_TYPES",
           "generate", "load_config", "load_model"]
