"""The models: decoder-only transformers built from Hugging Face checkpoint folders (the Llama
family and OPT), their configs and weights, and the attention contexts through which a model
reaches its keys and values — one sequence's cache for the teaching loop, or the engine's paged
step (``AttentionMetadata``). The model's arithmetic comes from the backend it is handed
(``ops``); it never imports the engine or the KV bookkeeping."""

from .attention import AttentionMetadata, KVCacheQuant, PagedAttention
from .cache import ContiguousCache, NoCache
from .config import SUPPORTED_MODEL_TYPES, ModelConfig, load_config
from .loader import build_model, load_model
from .registry import MODELS, resolve_model

__all__ = ["AttentionMetadata", "ContiguousCache", "KVCacheQuant", "ModelConfig", "NoCache",
           "PagedAttention", "MODELS", "SUPPORTED_MODEL_TYPES", "build_model", "load_config",
           "load_model", "resolve_model"]
