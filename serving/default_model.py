"""The model every command uses when none is named: the tiny model that ships with pagedllm.

``pagedllm/models/tiny-pydoc`` is a 3.9M-parameter Llama-family model (grouped-query attention)
trained by ``training/train_tiny.py`` on the documentation that ships with Python. It is small
enough to commit and to run on any CPU, and trained enough to write words, so the demo and the
lessons show real (if odd) text with no download.
"""

from pathlib import Path

import pagedllm

DEFAULT_MODEL_DIR = Path(pagedllm.__file__).resolve().parent / "models" / "tiny-pydoc"


def default_model_dir() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"the shipped model is missing from {DEFAULT_MODEL_DIR}; reinstall "
                         "pagedllm or rebuild it with `python training/train_tiny.py`")
    return DEFAULT_MODEL_DIR
