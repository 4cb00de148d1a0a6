"""Bad input answers with a ValueError that says what was wrong and what would be right."""

import json

import pytest

from pagedllm.reference import generate, load_model
from pagedllm.reference.model.config import SUPPORTED_MODEL_TYPES


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2'") as err:
        load_model(tmp_path)
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)


def test_folder_without_weights(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)


def test_token_ids_outside_the_vocabulary(checkpoints):
    model = load_model(checkpoints["llama"])
    with pytest.raises(ValueError, match=r"\[257\] are outside the vocabulary; valid ids are 0"):
        generate(model, [1, 257], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [-1], 4)


def test_empty_prompt(checkpoints):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(load_model(checkpoints["opt"]), [], 4)


def test_too_long_and_bad_parameters(checkpoints):
    model = load_model(checkpoints["llama"])
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        generate(model, [1] * 250, 10)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, [1], 0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, [1], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="cache 'paged' is unknown"):
        generate(model, [1], 2, cache="paged")
