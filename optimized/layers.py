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
import torch.nn.functional as F
from torch import nn

from pagedllm.reference.model.deepseek_v2 import DeepseekV2ForCausalLM
from pagedllm.reference.model.gemma3 import Gemma3Attention, Gemma3ForCausalLM, Gemma3MLP
from pagedllm.reference.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from pagedllm.reference.model.opt import OPTAttention, OPTForCausalLM
from pagedllm.reference.model.quantization import QuantizedLinear, decoder_stack
from pagedllm.reference.ops.weight_quant import QuantizedWeight


# --8<-- [start:merged_linear]
def _merged_linear(parts: list[nn.Module]) -> nn.Module:
    """One Linear whose output is the parts' outputs side by side."""
    if isinstance(parts[0], QuantizedLinear):
        return _merged_quantized(parts)
    weight = torch.cat([p.weight for p in parts])  # [sum(out), in]
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                       device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        merged.bias = nn.Parameter(torch.cat([p.bias for p in parts]),
                                   requires_grad=False)
    return merged
# --8<-- [end:merged_linear]


def _merged_quantized(parts: list[QuantizedLinear]) -> QuantizedLinear:
    """Quantized parts side by side: every scale and zero point belongs to one output row, so
    stacking the rows is exactly the quantization of the stacked weight."""
    qs = [p.quantized for p in parts]
    zeros = None if qs[0].zeros is None else torch.cat([q.zeros for q in qs])
    merged = QuantizedWeight(qs[0].scheme, torch.cat([q.qweight for q in qs]),
                             torch.cat([q.scales for q in qs]), zeros,
                             (sum(q.shape[0] for q in qs), qs[0].shape[1]), qs[0].group_size)
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    return QuantizedLinear(merged, bias)


class MergedLlamaAttention(nn.Module):
    """LlamaAttention with q_proj, k_proj and v_proj as one qkv_proj."""

    def __init__(self, ref: LlamaAttention, device: torch.device):
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
        self.inv_freq = ref.inv_freq.to(device)
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
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale,
                          self.sliding_window)
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]
    # --8<-- [end:merged_attention]


# --8<-- [start:merged_mlp]
class MergedLlamaMLP(nn.Module):
    """LlamaMLP with gate_proj and up_proj as one gate_up_proj, whose output is
    [T, 2 * intermediate]: the gate's half, then the up half."""

    def __init__(self, ref: LlamaMLP):
        super().__init__()
        self.gate_up_proj = _merged_linear([ref.gate_proj, ref.up_proj])
        self.down_proj = ref.down_proj

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))  # [T, hidden]
# --8<-- [end:merged_mlp]


class MergedGemma3Attention(nn.Module):
    """Gemma3Attention with one qkv_proj: the same merge as Llama's (the per-head norms, the
    layer kind's rotary and window are the reference's, untouched)."""

    def __init__(self, ref: Gemma3Attention, device: torch.device):
        super().__init__()
        self.layer_idx, self.head_dim = ref.layer_idx, ref.head_dim
        self.num_heads, self.num_kv_heads = ref.num_heads, ref.num_kv_heads
        self.qkv_proj = _merged_linear([ref.q_proj, ref.k_proj, ref.v_proj])
        self.o_proj, self.q_norm, self.k_norm = ref.o_proj, ref.q_norm, ref.k_norm
        self.inv_freq = ref.inv_freq.to(device)  # once, as MergedLlamaAttention does
        self.sliding_window, self.scale = ref.sliding_window, ref.scale
        self.sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                      self.num_kv_heads * self.head_dim]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        T, ops = x.shape[0], attn.backend
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [T, qkv] output
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))  # [T, heads, head_dim]
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(q, k, positions, self.inv_freq)
        out = attn.attend(self.layer_idx, q, k, v, positions, self.scale,
                          self.sliding_window)
        return self.o_proj(out.reshape(T, -1))  # [T, hidden]


class MergedGemma3MLP(nn.Module):
    """Gemma3MLP with one gate_up_proj; GeGLU's gelu (tanh) is torch's, as in the reference
    (the backend has no GELU op)."""

    def __init__(self, ref: Gemma3MLP):
        super().__init__()
        self.gate_up_proj = _merged_linear([ref.gate_proj, ref.up_proj])
        self.down_proj = ref.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, inter] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # [T, hidden]


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


# --8<-- [start:transposed_linear]
class TransposedLinear(nn.Module):
    """nn.Linear with its weight stored transposed: [in, out] contiguous.

    It computes y = x @ W^T + b, as nn.Linear does. A decode step multiplies a few rows
    by each weight. On a CPU the BLAS library does that about twice as fast with the
    weight row-major in the product's own orientation ([in, out]) as with the transpose
    of nn.Linear's [out, in] (measured on this project's 2-core machine, one thread: the
    tiny model's 17 products, 1 to 3 rows). The sums are the same products, added in a
    different order by the library: results agree to float rounding, not bit for bit.
    On CUDA cuBLAS reads either layout at full speed, and nn.Linear stays.
    """

    def __init__(self, linear: nn.Linear, weight_t: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if weight_t is None:
            weight_t = linear.weight.detach().t().contiguous()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)  # [in, out]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t  # [T, out]
        return torch.addmm(self.bias, x, self.weight_t)  # [T, out]


class TransposedEmbedding(nn.Module):
    """An embedding whose table is a tied LM head's transposed weight [hidden, vocab].

    One copy of the table serves both, as the checkpoint's tied weights do."""

    def __init__(self, weight_t: torch.Tensor):
        super().__init__()
        self.weight_t = weight_t  # [hidden, vocab], the LM head's Parameter

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight_t.index_select(1, token_ids).t().contiguous()  # [T, hidden]


def transpose_linears(model: nn.Module) -> nn.Module:
    """Every nn.Linear of the model as a TransposedLinear (the CPU's faster layout).

    A tied LM head shares its transposed table with the input embedding, as before the
    swap."""
    stack = decoder_stack(model)
    head = model.lm_head  # tied: one storage for both (the loader's assign=True)
    tied = isinstance(head, nn.Linear) and \
        head.weight.data_ptr() == stack.embed_tokens.weight.data_ptr()
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, TransposedLinear(child))
    if tied:
        stack.embed_tokens = TransposedEmbedding(model.lm_head.weight_t)
    return model
# --8<-- [end:transposed_linear]


def merge_projections(model: nn.Module) -> nn.Module:
    """The reference model, its attention (and Llama / Gemma 3 MLP) projections merged in
    place."""
    device = next(model.parameters()).device  # the embedding's: never quantized
    if isinstance(model, LlamaForCausalLM):
        frequencies = {}  # equal rotary frequencies, one tensor: a step's tables are shared
        for layer in model.model.layers:
            layer.self_attn = MergedLlamaAttention(layer.self_attn, device)
            layer.mlp = MergedLlamaMLP(layer.mlp)
            inv_freq = layer.self_attn.inv_freq
            layer.self_attn.inv_freq = frequencies.setdefault(tuple(inv_freq.tolist()),
                                                              inv_freq)
    elif isinstance(model, OPTForCausalLM):
        for layer in model.model.decoder.layers:
            layer.self_attn = MergedOPTAttention(layer.self_attn)
    elif isinstance(model, Gemma3ForCausalLM):
        # Merged as Llama's (two products fewer a layer); the layers of one kind, local or
        # global, share one frequency tensor, as Llama's equal ones do.
        frequencies = {}
        for layer in model.model.layers:
            layer.self_attn = MergedGemma3Attention(layer.self_attn, device)
            layer.mlp = MergedGemma3MLP(layer.mlp)
            inv_freq = layer.self_attn.inv_freq
            layer.self_attn.inv_freq = frequencies.setdefault(tuple(inv_freq.tolist()),
                                                              inv_freq)
    elif isinstance(model, DeepseekV2ForCausalLM):
        pass  # its projections feed the latent path separately (q, the latent, o): kept
    else:
        raise ValueError(f"the optimized tier runs the Llama family, OPT, Gemma 3 and "
                         f"DeepSeek-V2, not {type(model).__name__}")
    return model.eval()
