"""The operations of one engine step, in plain torch: the readable definitions the Triton
kernels must match (each kernel file imports its twin from here and tests against it).

A model does not import these functions directly: it is handed a ``Backend``, a bundle of them,
so that the optimized tier can hand in its own (Triton on CUDA, the kernels under the
interpreter, or a vectorized CPU path) and run the same model code. Nothing here knows about
sequences, schedulers or block managers: every op works on tensors alone.
"""

from collections.abc import Callable
from dataclasses import dataclass

from .activation import silu_and_mul
from .attention import causal_attention, gather_kv, paged_attention
from .cache_ops import copy_blocks, store_kv, swap_blocks
from .kv_quant import KV_CACHE_DTYPES, KVCacheFormat, dequantize_kv, kv_cache_format, quantize_kv
from .layernorm import rms_norm
from .mla import paged_mla_attention, store_latent
from .rotary import rotary
from .sampling import SamplerOutput, SamplingMetadata, sample
from .spec_decode import accepted_lengths


def keep_weights(model, dtype):
    """The reference's linear products: each layer's own forward (nn.Linear, or the
    quantized twin that dequantizes its weight), so the model is kept as it is."""
    return model


@dataclass(frozen=True)
class Backend:
    """Who computes each op of the step. Swap one field to swap one implementation.

    Besides the per-call ops, a backend says how the linear layers multiply
    (``process_weights``, applied once after loading, as vLLM's
    ``process_weights_after_loading``: the weights repacked for its kernels), which attention
    context a step builds from its metadata (``attention_context``: once per step, vLLM's
    metadata builder; None is the model's ``PagedAttention``), and what may run a whole step
    in one call (``whole_step``: given the model runner, an object with ``runs(attn)`` and the
    model's call signature, or None; a CUDA graph, the CPU's one-call decode step)."""

    name: str = "reference"
    store_kv: Callable = store_kv
    paged_attention: Callable = paged_attention
    copy_blocks: Callable = copy_blocks
    swap_blocks: Callable = swap_blocks
    rms_norm: Callable = rms_norm
    rotary: Callable = rotary
    silu_and_mul: Callable = silu_and_mul
    sample: Callable = sample
    # multi-head latent attention (mla.py): a layer's latent rows, and the absorbed decode
    store_latent: Callable = store_latent
    paged_mla_attention: Callable = paged_mla_attention
    # speculative decoding's verification: proposals kept per run (spec_decode.py)
    accepted_lengths: Callable = accepted_lengths
    process_weights: Callable = keep_weights  # (model, dtype) -> model
    attention_context: type | None = None
    whole_step: Callable | None = None  # (runner) -> a step object, or None


REFERENCE_BACKEND = Backend()

__all__ = ["Backend", "KVCacheFormat", "KV_CACHE_DTYPES", "REFERENCE_BACKEND", "SamplerOutput",
           "SamplingMetadata", "accepted_lengths", "causal_attention", "copy_blocks",
           "dequantize_kv", "gather_kv", "keep_weights", "kv_cache_format", "paged_attention",
           "paged_mla_attention", "quantize_kv", "rms_norm", "rotary", "sample",
           "silu_and_mul", "store_kv", "store_latent", "swap_blocks"]
