"""GGUF files (llama.cpp's format) turned into ordinary Hugging Face checkpoint folders.

A GGUF file holds everything a model needs in one file: the architecture's hyper-parameters, the
tokenizer (vocabulary, merges, special tokens, chat template) and the tensors, most of them
quantized in blocks (Q4_1: 32 weights share one fp16 scale and one fp16 minimum, 4 bits each).
The reference model computes in float32/16/bf16, so a GGUF checkpoint is dequantized once and
written as a normal folder (config.json, model.safetensors, tokenizer files) that every loader
of this project reads as it reads any other checkpoint.

The reading and dequantizing are the `gguf` package's (ggml's own Python reader). The metadata
and the mapping of GGUF tensor names to Hugging Face's (``blk.3.attn_q.weight`` →
``model.layers.3.self_attn.q_proj.weight``, with llama.cpp's reordering of the q/k rows undone)
are transformers' GGUF support, used as it is rather than re-derived here.
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..ops.weight_quant import QuantizedWeight

# The tensor types this converter accepts: float, and the classic block-quantized formats.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SOURCE_FILE = "converted-from.json"  # what a converted folder was made from


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file that path names (a .gguf file, or a folder holding exactly one and no
    config.json), or None when path is something else."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds {len(found)} GGUF files "
                             f"({', '.join(f.name for f in found)}); name one of them")
        return found[0] if found else None
    return None


def _reader(gguf_file: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_file)
    except Exception as err:  # its own parser's errors: a truncated or foreign file
        raise ValueError(f"{gguf_file} is not a readable GGUF file ({type(err).__name__}: "
                         f"{err}); it may be truncated: download or reinstall it") from err


def check_tensor_types(gguf_file: Path) -> None:
    """Refuse, naming the tensor and its type, a file holding a type outside the supported
    list (the k-quants and i-quants of newer llama.cpp files, for instance)."""
    for tensor in _reader(gguf_file).tensors:
        if tensor.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(f"{gguf_file}: tensor {tensor.name!r} has type "
                             f"{tensor.tensor_type.name}, which this converter does not "
                             f"dequantize; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize gguf_file into the Hugging Face folder out_dir: config.json,
    model.safetensors in dtype, the tokenizer with its chat template. Returns out_dir.

    Written to a temporary folder first and renamed at the end, so an interrupted conversion
    never leaves a folder that looks complete.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_tensor_types(gguf_file)
    try:
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        with torch.device("meta"):  # only for its parameter names: no memory, no init
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True,
                                       model_to_load=skeleton)["tensors"]
    except ValueError:
        raise
    except Exception as err:  # transformers' refusals: an architecture it cannot map, ...
        raise ValueError(f"{gguf_file} could not be converted by transformers' GGUF support "
                         f"({type(err).__name__}: {err})") from err
    config.dtype = dtype
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out_dir)
    # A folder of this call's own: two processes converting the same file at once must not
    # write into (or delete) each other's half-made folder.
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial-", dir=out_dir.parent))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()},
              tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / SOURCE_FILE).write_text(json.dumps(
        {**_identity(gguf_file), "dtype": str(dtype).removeprefix("torch.")}, indent=1))
    if is_converted_from(out_dir, gguf_file):  # another process finished the same work first
        shutil.rmtree(tmp, ignore_errors=True)
        return out_dir
    if out_dir.exists():  # a stale conversion of another file: replace it whole
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process renamed its conversion into place in between
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_converted_from(out_dir, gguf_file):
            raise
    return out_dir


def _remove_stale_partials(out_dir: Path, age_s: float = 3600.0) -> None:
    """Delete the half-made folders an interrupted conversion left next to out_dir (a whole
    model's weights each); only old ones, since a young one may be another process's work."""
    for stale in out_dir.parent.glob(out_dir.name + ".partial*"):
        try:
            if time.time() - stale.stat().st_mtime > age_s:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # removed by someone else meanwhile


def converted_from(folder: Path) -> Path | None:
    """The GGUF file a converted folder was made from (None for any other folder)."""
    try:
        return Path(json.loads((Path(folder) / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _identity(gguf_file: Path) -> dict:
    """What tells a GGUF file from another at the same path: a file replaced by a different one
    of the same size (a re-quantization, a re-download) must be converted again, so the
    modification time counts too."""
    stat = gguf_file.stat()
    return {"gguf": str(gguf_file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def is_converted_from(folder: Path, gguf_file: Path) -> bool:
    """True when folder is a finished conversion of this very file (same path, size and
    modification time)."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
        return all(source.get(key) == value for key, value in _identity(gguf_file).items())
    except (OSError, ValueError, AttributeError):  # no record, a corrupt one, no file
        return False


# -- serving the file's own 4-bit blocks (quantization="gguf") ------------------------------
# --8<-- [start:gguf_blocks]
def q4_blocks_to_int4(raw: torch.Tensor, kind: str,
                      dtype: torch.dtype) -> QuantizedWeight:
    """A Q4_0 / Q4_1 tensor's rows of blocks -> the int4 layout of
    ``ops/weight_quant.py`` (groups of 32), without going through float weights.

    raw: uint8 [out, in / 32 * block bytes]. A block is 32 weights of one row: an
    fp16 scale d (Q4_1: and an fp16 minimum m), then 16 bytes whose low nibbles are
    weights 0-15 and high nibbles weights 16-31. Q4_0 means (q - 8) d, Q4_1 means
    q d + m; ours is (q - 8) s + z, so s = d, and z = 0 (Q4_0) or m + 8 d (Q4_1),
    rounded to the model's dtype.
    """
    out = raw.shape[0]
    head = 2 if kind == "Q4_0" else 4  # bytes of d (and m) before the 16 code bytes
    blocks = raw.view(out, -1, head + 16)  # [out, G, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [out, G]
    if kind == "Q4_0":
        zero = torch.zeros_like(d)
    else:
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        zero = m + 8 * d
    qs = blocks[..., head:]  # [out, G, 16]
    # [out, in] in the file's order, then packed as ours (the even input low)
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(out, -1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [out, in / 2]
    inp = codes.shape[1]
    return QuantizedWeight("int4", packed, d.to(dtype), zero.to(dtype), (out, inp), 32)


def unpermute_rows(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's reordering of q/k rows (its converter
    permutes each head's rows for its rotary layout): hf = gguf[order]."""
    p = torch.arange(rows).reshape(n_head, 2, rows // n_head // 2)
    p = p.swapaxes(1, 2).reshape(-1)  # gguf row i holds hf row p[i]
    return torch.argsort(p)
# --8<-- [end:gguf_blocks]


def gguf_quantized_weights(gguf_file: Path, model_config, names: list[str],
                           dtype: torch.dtype) -> tuple[dict, dict]:
    """For each linear layer name (Hugging Face's), the file's blocks as a QuantizedWeight
    where the file stores the layer as Q4_0 / Q4_1; the others, with their type, apart."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    reader = _reader(gguf_file)
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = {v: k for k, v in MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch != MODEL_ARCH.LLAMA:
        raise ValueError(f"quantization 'gguf' serves the blocks of Llama-architecture files; "
                         f"{gguf_file.name} is {arch_name!r}: leave quantization unset to run "
                         "its dequantized weights")
    name_map = get_tensor_name_map(arch, model_config.num_layers)
    tensors = {t.name: t for t in reader.tensors}
    found, other = {}, {}
    for name in names:
        gname = name_map.get_name(name + ".weight", try_suffixes=(".weight",))
        tensor = tensors.get(gname)
        kind = tensor.tensor_type.name if tensor is not None else "absent (tied)"
        if kind not in ("Q4_0", "Q4_1"):
            other[name] = kind
            continue
        raw = torch.from_numpy(tensor.data.copy())  # [out, bytes per row]
        qw = q4_blocks_to_int4(raw, kind, dtype)
        if name.endswith(("q_proj", "k_proj")):
            heads = model_config.num_heads if name.endswith("q_proj") else \
                model_config.num_kv_heads
            order = unpermute_rows(qw.shape[0], heads)
            qw = QuantizedWeight("int4", qw.qweight[order], qw.scales[order], qw.zeros[order],
                                 qw.shape, 32)
        found[name] = qw
    return found, other
