"""Read a checkpoint's tensors from safetensors files: one model.safetensors, or shards listed
in model.safetensors.index.json (what save_pretrained writes for large models)."""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

SAVE_HINT = "save the model with save_pretrained (safetensors is its default format)"


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_state_dict_and_sources(model_dir)[0]


def load_state_dict_and_sources(model_dir: str | Path
                                ) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """The tensors, and the file each was read from (so a bad tensor's error can name it)."""
    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    sources: dict[str, Path] = {}
    for file in weight_files(model_dir):
        try:
            tensors = load_file(file)
        except SafetensorError as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err}); it may be "
                             f"truncated or in another format: {SAVE_HINT}") from err
        for name, tensor in tensors.items():
            if name in state:  # two shards disagreeing would make the result depend on order
                raise ValueError(f"tensor {name!r} is stored twice, in {sources[name]} and "
                                 f"{file}; each tensor must be in exactly one shard")
            state[name], sources[name] = tensor, file
    return state, sources


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a folder, every one of them present."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return _shards(index)
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    found = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt*"))
    other = f" (found {', '.join(found[:3])}: PyTorch pickles are not read)" if found else ""
    raise ValueError(f"{str(model_dir)!r} has neither model.safetensors nor "
                     f"model.safetensors.index.json{other}; {SAVE_HINT}")


def _shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{index} is not valid JSON ({err}); it should be the index "
                         "save_pretrained writes: {\"weight_map\": {tensor: shard file}}") from err
    except (KeyError, TypeError) as err:
        raise ValueError(f"{index} has no \"weight_map\" object; it should be the index "
                         "save_pretrained writes: {\"weight_map\": {tensor: shard file}}") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: \"weight_map\" must be a non-empty object mapping each "
                         f"tensor name to its shard file, got {weight_map!r:.80}")
    names = sorted(set(weight_map.values()), key=str)
    # A shard is a file beside the index: a path elsewhere would read files outside the folder.
    bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")]
    if bad:
        raise ValueError(f"{index} names shard {bad[0]!r}; shards must be plain file names of "
                         "files in the same folder, e.g. \"model-00001-of-00002.safetensors\"")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise ValueError(f"{index} names {len(missing)} shard(s) missing from "
                         f"{str(index.parent)!r}: {', '.join(missing[:4])}; copy every shard the "
                         f"index lists, or {SAVE_HINT}")
    return [index.parent / n for n in names]
