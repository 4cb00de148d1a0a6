"""The reference model with its projections merged: one matmul for Q, K and V, one for gate and up.

A decode step of a small batch is a string of thin matrix products, each reading its whole weight
to multiply a few rows. Reading Q's, K's and V's weights in one product instead of three moves
the same bytes but makes one call instead of three, with a wider output that the matmul library
tiles better; on the GPU it is one kernel launch instead of three. The same holds for the MLP's
gate and up projections, whose outputs ``silu_and_mul`` wants side by side anyway.

Nothing else changes: the merged modules replace ``self_attn`` and ``mlp`` inside the reference's
decoder layers, so the layer, the residual stream, the norms and the logits are the reference's
code, on the backend's ops. The weights are the reference loader's, concatenated once at load.
"""

import torch
from torch import nn

from pagedllm.reference.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedllm.reference.model.opt import OPTAttention, OPTForCausalLM


# --8<-- [start:merged_linear]
def _merged_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs side by side."""
    weight = torch.cat([p.weight for p in parts])  # [sum(out), in]
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                       device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        merged.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return merged
# --8<-- [end:merged_linear]


class MergedLlamaAttention(nn.Module):
    """LlamaAttention with q_proj, k_proj and v_proj as one qkv_proj."""

    def __init__(self, ref: LlamaAttention):
        super().__init__()
        self.layer_idx, self.head_dim = ref.layer_idx, ref.head_dim
        self.num_heads, self.num_kv_heads = ref.num_heads, ref.num_kv_heads
        self.qkv_proj = _merged_linear([ref.q_proj, ref.k_proj, ref.v_proj])
        self.o_proj = ref.o_proj
        self.qk_norm = ref.qk_norm
        if ref.qk_norm:
            self.q_norm, self.k_norm = ref.q_norm, ref.k_norm
        # On the weights' device once: the reference moves it at every call, a host-to-device
        # copy per layer that a CUDA graph cannot even record.
        self.inv_freq = ref.inv_freq.to(self.qkv_proj.weight.device)
        self.sliding_window, self.scale = ref.sliding_window, ref.scale
        self.sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim]

    # --8<-- [start:merged_attention]
    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        T, ops = x.shape[0], attn.backend
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [T, qkv] output
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, heads, head_dim]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3
            q = self.q_norm(q, ops=ops)[0]
            k = self.k_norm(k, ops=ops)[0]
        q, k = ops.rotary(q, k, positions, self.inv_freq)
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]
    # --8<-- [end:merged_attention]


# --8<-- [start:merged_mlp]
class MergedLlamaMLP(nn.Module):
    """LlamaMLP with gate_proj and up_proj as one gate_up_proj: [T, 2 * intermediate]."""

    def __init__(self, ref: LlamaMLP):
        super().__init__()
        self.gate_up_proj = _merged_linear([ref.gate_proj, ref.up_proj])
        self.down_proj = ref.down_proj

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # [T, hidden]
# --8<-- [end:merged_mlp]


class MergedOPTAttention(nn.Module):
    """OPTAttention with one qkv_proj."""

    def __init__(self, ref: OPTAttention):
        super().__init__()
        self.layer_idx, self.num_heads, self.head_dim = ref.layer_idx, ref.num_heads, ref.head_dim
        self.qkv_proj = _merged_linear([ref.q_proj, ref.k_proj, ref.v_proj])
        self.out_proj, self.scale = ref.out_proj, ref.scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (t.reshape(T, self.num_heads, self.head_dim)
                   for t in self.qkv_proj(x).chunk(3, dim=-1))  # [T, heads, head_dim] each
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale)
        return self.out_proj(out.reshape(T, -1))  # [T, hidden]


def merge_projections(model: nn.Module) -> nn.Module:
    """The reference model, its attention (and Llama MLP) projections merged in place."""
    if isinstance(model, LlamaForCausalLM):
        for layer in model.model.layers:
            layer.self_attn = MergedLlamaAttention(layer.self_attn)
            layer.mlp = MergedLlamaMLP(layer.mlp)
    elif isinstance(model, OPTForCausalLM):
        for layer in model.model.decoder.layers:
            layer.self_attn = MergedOPTAttention(layer.self_attn)
    else:
        raise ValueError(f"the optimized tier runs the Llama family and OPT, not "
                         f"{type(model).__name__}")
    return model.eval()
