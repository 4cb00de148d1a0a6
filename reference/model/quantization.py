"""Quantizing a loaded model's linear layers in place (``quantization="int8"`` / ``"fp8"`` /
``"int4"``, or
``"gguf"``: a GGUF file's own 4-bit blocks).

Every ``nn.Linear`` becomes a ``QuantizedLinear`` holding its codes and scales
(``ops/weight_quant.py``) instead of the float weight: the float copy is dropped, so the weight
bytes shrink by the scheme's ratio. Embeddings and norms stay in the model's dtype. A layer
named in ``skip`` keeps its float weight (``skip_matches``: its full module name or a run of its
dot-separated parts, e.g. ``lm_head``, ``down_proj``, ``mlp.down_proj``); a skip entry that names
no linear layer is refused (``check_skip``), as a typo would otherwise quantize every layer.
A tied LM head stays the embedding's float table (quantizing it would make a second copy).
"""

from pathlib import Path

import torch
from torch import nn

from ..ops.weight_quant import (
    INT4_GROUP_SIZES,
    WEIGHT_QUANTIZATIONS,
    QuantizedWeight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantized_linear,
)
from .gguf import gguf_quantized_weights
from .opt import OPTForCausalLM


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module holding the input embedding (``embed_tokens``), whose table a tied LM head
    shares: ``model.model`` for the Llama family, ``model.model.decoder`` for OPT."""
    return model.model.decoder if isinstance(model, OPTForCausalLM) else model.model


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized; the product is the twin's."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.quantized = qweight
        self.bias = bias
        # Buffers, so that the module's tensors are counted and listed like any weight's.
        self.register_buffer("qweight", qweight.qweight, persistent=False)
        self.register_buffer("scales", qweight.scales, persistent=False)
        if qweight.zeros is not None:
            self.register_buffer("zeros", qweight.zeros, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.quantized, self.bias)  # [T, out]

    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.quantized.nbytes() + bias


def check_quantization(scheme, group_size) -> None:
    """The scheme's name and int4's group size (ValueError naming the field)."""
    if scheme is not None and scheme not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"quantization {scheme!r} is unknown; choose None (the checkpoint's "
                         f"weights) or one of {WEIGHT_QUANTIZATIONS}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES} for int4, "
                         f"got {group_size!r}")


def skip_matches(entry: str, name: str) -> bool:
    """Whether the quantization_skip entry names the linear layer ``name`` (its module name,
    e.g. ``model.layers.0.mlp.down_proj``): the entry is the full name or any run of its
    dot-separated parts taken whole, in order and side by side: ``down_proj``,
    ``mlp.down_proj``, ``layers.0.mlp.down_proj`` and ``layers.0`` match it; ``down``,
    ``proj``, ``down-proj``, ``mlp.up_proj`` and ``layers.mlp`` do not. No wildcards and no
    partial parts, so a name cannot catch a layer by accident (``proj`` is not every
    projection). Under tensor parallelism a row-parallel layer is ``...o_proj.linear``: the
    same entries match it."""
    want, parts = entry.split("."), name.split(".")
    n = len(want)
    return any(parts[i:i + n] == want for i in range(len(parts) - n + 1))


def linear_names(model: nn.Module) -> list[str]:
    """The module names of the model's linear layers (``nn.Linear``), in order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def check_skip(skip, model: nn.Module) -> None:
    """Every skip entry names at least one linear layer of the model (``skip_matches``);
    otherwise a ValueError naming quantization_skip, the entries that match nothing and the
    layers' distinct last parts. Nothing else would tell a typo (``down-proj``) from a layer
    left float: the model would be quantized whole without a word."""
    names = linear_names(model)
    unmatched = [entry for entry in skip if not any(skip_matches(entry, n) for n in names)]
    if not unmatched:
        return
    if not names:
        raise ValueError(f"quantization_skip {list(unmatched)!r}: this model has no linear "
                         "layers to leave out")
    last = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in names))
    example = names[0].split(".")
    runs = ", ".join(dict.fromkeys(repr(".".join(example[-n:])) for n in (1, 2, len(example))))
    raise ValueError(f"quantization_skip {', '.join(map(repr, unmatched))} "
                     f"match{'es' if len(unmatched) == 1 else ''} no linear layer of this "
                     f"model; its linear layers end in {last}. An entry names a layer by its "
                     f"full module name or a run of its dot-separated parts (e.g. {runs})")


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32,
                   skip: tuple[str, ...] = (), gguf_file: Path | None = None,
                   row_absmax: dict[str, torch.Tensor] | None = None,
                   saved: dict[str, QuantizedWeight] | None = None) -> nn.Module:
    """Replace the model's linear layers by quantized ones, in place. Every layer is checked
    before any is replaced: a group size that does not divide one layer's input size names that
    layer, and the model is left as it was. "gguf" takes the layers the file stores in 4-bit
    blocks from the file itself; the others keep their (dequantized) float weights, and
    ``float_linears`` names them. A tied LM head is left as it is: it is the embedding's
    table, which stays float, and a quantized copy would add its bytes and its error.
    skip: the layers left float, each entry matched by ``skip_matches`` (for "gguf" too: a
    skipped layer is not looked up in the file and keeps the float weight the file was
    converted to); an entry that matches no linear layer is a ValueError (``check_skip``).
    row_absmax: {layer name: [out]} the whole rows' max |w| for layers that hold a slice of
    their inputs (tensor parallelism's row-parallel shards): int8 and fp8 scale them by it.
    saved: {layer name: QuantizedWeight} a quantized checkpoint's own codes (GPTQ's, from
    ``pagedllm quantize``), put in place as they are instead of rounding the weight again."""
    # --8<-- [start:select_layers]
    check_quantization(scheme, group_size)
    check_skip(skip, model)
    embedding = decoder_stack(model).embed_tokens.weight
    names = {name: module for name, module in model.named_modules()
             if isinstance(module, nn.Linear)
             and not any(skip_matches(entry, name) for entry in skip)
             and module.weight.data_ptr() != embedding.data_ptr()}  # not a tied head
    if scheme == "gguf":
        dtype = next(model.parameters()).dtype
        found, _ = gguf_quantized_weights(gguf_file, model.config, list(names), dtype)
        for name, qw in found.items():
            _replace(model, name, QuantizedLinear(qw, names[name].bias))
        return model
    # --8<-- [end:select_layers]
    if scheme == "int4":
        bad = [f"{name} (in {m.in_features})" for name, m in names.items()
               if m.in_features % group_size]
        if bad:
            raise ValueError(f"quantization_group_size {group_size} does not divide the input "
                             f"size of {', '.join(bad[:4])}; choose a group size that divides "
                             f"it, or leave the layer out with quantization_skip")
    # --8<-- [start:replace_layers]
    for name, linear in names.items():
        absmax, q = (row_absmax or {}).get(name), (saved or {}).get(name)
        q = q if q is not None else \
            quantize_int8(linear.weight, absmax) if scheme == "int8" else \
            quantize_fp8(linear.weight, absmax) if scheme == "fp8" else \
            quantize_int4(linear.weight, group_size)
        _replace(model, name, QuantizedLinear(q, linear.bias))
    return model
    # --8<-- [end:replace_layers]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def float_linears(model: nn.Module) -> list[str]:
    """The linear layers left in float: skipped, or (gguf) not stored in 4-bit blocks."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds, parameters and buffers (quantized codes and
    scales are buffers), each storage counted once: a tied table is one table."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
