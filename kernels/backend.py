"""TRITON_OPS: every per-call op of the step as its Triton kernel, in one ``Backend``.

Every launcher has its twin's signature, so the kernels plug into a model as one bundle. Each
runs its kernel on CUDA tensors, under Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1``, and as the twin otherwise (``runtime.py``). Swapping blocks between the
GPU and CPU pools is a copy, not a kernel: it stays the twin's. ``accepted_lengths`` is
speculative decoding's verification (``spec_decode.py``), which the scheduler calls through the
runner's backend on the sampled tokens where the sampler left them. ``optimized/backend.py`` adds
what else the tier swaps on a GPU (the quantized products, the attention context, CUDA graphs)
to make ``TRITON_BACKEND``.
"""

from pagedllm.reference.ops import Backend, swap_blocks

from .copy_blocks import copy_blocks
from .mla_decode import paged_mla_attention
from .paged_attention import paged_attention
from .rms_norm import rms_norm
from .rotary import rotary
from .sampling import sample
from .silu_and_mul import silu_and_mul
from .spec_decode import accepted_lengths
from .store_kv import store_kv

TRITON_OPS = Backend(name="triton-ops", store_kv=store_kv, paged_attention=paged_attention,
                     copy_blocks=copy_blocks, swap_blocks=swap_blocks, rms_norm=rms_norm,
                     rotary=rotary, silu_and_mul=silu_and_mul, sample=sample,
                     accepted_lengths=accepted_lengths, paged_mla_attention=paged_mla_attention)
