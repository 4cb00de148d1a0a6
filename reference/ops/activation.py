"""SwiGLU's activation: silu(gate) * up, on the gate and up projections laid side by side.

The Llama MLP is down(silu(gate(x)) * up(x)). Computing gate and up as one matmul (the
optimized tier merges the two weights) gives [T, 2 * intermediate]; this op turns that into
[T, intermediate] in one pass over memory.
"""

import torch
import torch.nn.functional as F


# --8<-- [start:silu_and_mul]
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
# --8<-- [end:silu_and_mul]
