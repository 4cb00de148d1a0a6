"""RMSNorm, with the residual add that precedes it in every decoder layer.

A Llama-family layer reads ``residual = x + sublayer(norm(x))`` twice; fusing the add into the
norm (vLLM's fused_add_rms_norm) lets a kernel read and write the hidden state once instead of
twice. The definition keeps the order of operations of Hugging Face's model: add in the model's
dtype, take the mean of squares in float32, scale by the weight.
"""

import torch


# --8<-- [start:rms_norm]
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] (plus residual [T, hidden] when given) -> (normed, new residual).

    Without a residual, the new residual is x itself (the first layer's input).
    """
    if residual is not None:
        x = x + residual  # [T, hidden]
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x
# --8<-- [end:rms_norm]
