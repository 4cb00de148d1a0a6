"""A checkpoint whose linear layers are saved quantized (what ``pagedllm quantize`` writes).

The folder is the source checkpoint's, with two differences:

- each quantized layer's ``<name>.weight`` holds its codes (float8_e4m3fn for fp8, int8 for
  int8) and ``<name>.weight_scale`` its scales, one per output channel, [out] in float32
  (the names compressed-tensors checkpoints use for vLLM; the layout of the codes is ours);
- config.json gains ``"quantization_config": {"quant_method": "pagedllm", "scheme": ...}``
  with how the codes were chosen (GPTQ's calibration) for the record.

Loading it gives the same ``QuantizedLinear`` layers as quantizing at load, holding the saved
codes as they are: ``EngineArgs(model=folder)`` runs the saved scheme without
``quantization=`` (naming another scheme is refused), and ``dtype="auto"`` computes in what a
quantized model computes in. vLLM reads compressed-tensors' own config, not this one.
"""

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..ops.weight_quant import QuantizedWeight, dequantize_weight

QUANT_METHOD = "pagedllm"
SAVED_SCHEMES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}  # scheme -> codes' dtype
SCALE = ".weight_scale"
# What a new folder does not take from its source: weights in any format (its own are written)
# and what described the source (a GGUF conversion's record would make it claim the file).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
NOT_COPIED = ("config.json", "model.safetensors.index.json", "converted-from.json")


def saved_scheme(quantization_config, source="config.json") -> str | None:
    """The scheme a checkpoint's config.json says its linear layers are saved in (None: float
    weights); a quantization_config this engine cannot read is refused by its quant_method."""
    if quantization_config is None:
        return None
    config = quantization_config if isinstance(quantization_config, dict) \
        else quantization_config.to_dict()  # transformers may hand a config object
    method, scheme = config.get("quant_method"), config.get("scheme")
    if method != QUANT_METHOD:
        raise ValueError(f"{source}: quantization_config's quant_method {method!r} is not "
                         f"read here; this engine loads float checkpoints (quantized at load "
                         f"with quantization=...) and folders written by `pagedllm quantize` "
                         f"(quant_method {QUANT_METHOD!r})")
    if scheme not in SAVED_SCHEMES:
        raise ValueError(f"{source}: quantization_config's scheme {scheme!r} is not one of "
                         f"{tuple(SAVED_SCHEMES)}")
    return scheme


def split_saved(state: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype
                ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """A saved quantized state -> (the state with every quantized weight dequantized to dtype,
    which builds the model as a float one would; {layer name: its saved QuantizedWeight}, the
    codes as saved and the scales in dtype, for ``quantize_model`` to put in place)."""
    state, saved = dict(state), {}
    for key in [k for k in state if k.endswith(SCALE)]:
        name = key.removesuffix(SCALE)
        if name + ".weight" not in state:
            raise ValueError(f"{key} has no {name}.weight to scale; the folder is incomplete: "
                             "write it again with `pagedllm quantize`")
        codes, scales = state.pop(name + ".weight"), state.pop(key)
        if codes.dtype != SAVED_SCHEMES[scheme] or codes.dim() != 2 \
                or scales.shape != (codes.shape[0],):
            raise ValueError(f"{name}: a saved {scheme} weight is {SAVED_SCHEMES[scheme]} codes "
                             f"[out, in] with scales [out]; got {codes.dtype} "
                             f"{tuple(codes.shape)} and scales {tuple(scales.shape)}")
        if not torch.equal(scales.to(dtype).float(), scales.float()):
            raise ValueError(f"{name}: its scales were chosen in another dtype and {dtype} "
                             "would round them, moving every weight off the grid GPTQ chose; "
                             "load it in the dtype `pagedllm quantize --dtype` was given "
                             "(quantization_config's \"dtype\")")
        qw = QuantizedWeight(scheme, codes, scales.to(dtype), None, tuple(codes.shape))
        saved[name] = qw
        state[name + ".weight"] = dequantize_weight(qw, dtype)  # [out, in]
    orphans = [k for k, t in state.items() if t.dtype == SAVED_SCHEMES[scheme]]
    if orphans:  # codes read as floats would be garbage weights, not an error
        raise ValueError(f"{orphans[0]} holds {scheme} codes but the checkpoint has no "
                         f"{orphans[0].removesuffix('.weight')}{SCALE} for them "
                         f"({len(orphans)} such tensors); the folder is incomplete: write it "
                         "again with `pagedllm quantize`")
    return state, saved


def save_quantized(source_dir: Path, out_dir: Path, state: dict[str, torch.Tensor],
                   quantized: dict[str, QuantizedWeight], record: dict) -> None:
    """Write out_dir: source_dir's files but its weights; state's tensors (the float ones),
    each quantized layer's codes and scales in place of its weight; config.json with the
    quantization_config (record: how the codes were chosen). The files go to a folder beside
    it first, renamed to out_dir once all are written: a run killed half-way never leaves a
    folder that looks like a checkpoint."""
    final = out_dir
    final.parent.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    for file in source_dir.iterdir():  # the tokenizer's files and the like
        if file.is_file() and file.suffix not in WEIGHT_SUFFIXES \
                and file.name not in NOT_COPIED:
            shutil.copy2(file, out_dir / file.name)
    tensors = {k: t.contiguous() for k, t in state.items()}
    for name, qw in quantized.items():
        tensors[name + ".weight"] = qw.qweight.contiguous()
        tensors[name + SCALE] = qw.scales.float().contiguous()
    save_file(tensors, out_dir / "model.safetensors")
    config = json.loads((source_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": QUANT_METHOD,
                                     "scheme": next(iter(quantized.values())).scheme,
                                     **record}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if final.exists():
        final.rmdir()  # empty: the caller refuses a folder with files in it
    out_dir.rename(final)
