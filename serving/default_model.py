"""The model every command uses when none is named.

Until the project ships a trained model, the default is a small random-weight Llama (grouped
heads, the byte tokenizer) that is written on first use into a cache folder: it proves the
machinery and the speed-up of the KV cache, but its text is noise.
"""

import os
from pathlib import Path

from pagedllm.reference.random_checkpoint import tiny_config, write_random_checkpoint

DEFAULT_MODEL_NAME = "random-llama-3m-v1"
DEFAULT_MODEL_IS_RANDOM = True


def cache_root() -> Path:
    """$PAGEDLLM_CACHE, else $XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm."""
    if os.environ.get("PAGEDLLM_CACHE"):
        return Path(os.environ["PAGEDLLM_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "pagedllm"


def write_default_model(path: Path) -> Path:
    """3.3M parameters: 4 layers, 8 query heads sharing 2 KV heads of 32, byte vocabulary."""
    config = tiny_config("llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024)
    return write_random_checkpoint(path, config, seed=0, init_std=0.2)


def default_model_dir() -> Path:
    """The default checkpoint folder, written (seeded, so always the same) if missing."""
    path = cache_root() / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = write_default_model(path.with_name(f"{path.name}.tmp{os.getpid()}"))
        try:
            tmp.rename(path)  # atomic: a half-written folder is never taken for a model
        except OSError:  # another process finished first; its copy is identical
            if not (path / "config.json").is_file():
                raise
    return path
