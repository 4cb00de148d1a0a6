"""The optimized tier's ops: the Triton kernels, with a vectorized CPU path for attention.

Every launcher in ``kernels/`` runs its kernel on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``) and its torch twin otherwise. The twins of the small ops are already
vectorized; the twin of paged attention loops over prompts, so on the CPU this tier uses
``attention.cpu_paged_attention`` instead.
"""

from dataclasses import replace

from pagedllm.kernels.backend import TRITON_BACKEND

from .attention import paged_attention

# --8<-- [start:backend]
OPTIMIZED_BACKEND = replace(TRITON_BACKEND, paged_attention=paged_attention)
# --8<-- [end:backend]
