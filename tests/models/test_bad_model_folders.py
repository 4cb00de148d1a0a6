"""A broken checkpoint folder is refused with a ValueError that names the file and says what is
wrong and what would be right: never a JSONDecodeError, ZeroDivisionError, SafetensorError or
a size-mismatch RuntimeError from deep inside a library.

Each test copies a good random checkpoint (conftest's `checkpoints`) and breaks one thing."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.reference.model import build_model, load_config, load_model
from pagedllm.reference.model.config import SUPPORTED_MODEL_TYPES
from pagedllm.reference.model.weights import load_state_dict

FLOATS = r"float32, float16, bfloat16"


def copy_of(checkpoints, tmp_path, family="llama3"):
    return shutil.copytree(checkpoints[family], tmp_path / family)


def edit_config(folder, **changes):
    """Set (or, with None, remove) fields of the folder's config.json."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---- the folder and config.json ---------------------------------------------------------------

def test_missing_folder_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"model folder .*nowhere' does not exist; pass a folder"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"has no config.json; a Hugging Face checkpoint"):
        load_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.safetensors' is a file, not a folder"):
        load_model(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="empty string"):
        load_config("")
    with pytest.raises(TypeError, match="model_dir must be a folder path"):
        load_config(42)


@pytest.mark.parametrize("content, message", [
    (b"{not json", r"config.json is not valid JSON \(Expecting property name"),
    (b"", r"config.json is not valid JSON \(Expecting value"),
    (b"\xff\xfe\x00garbage", r"config.json is not valid JSON"),
    (b"[1, 2, 3]", r"config.json holds a JSON list, not an object"),
    (b'"llama"', r"config.json holds a JSON str, not an object"),
], ids=["syntax", "empty", "binary", "list", "string"])
def test_config_that_is_not_a_json_object(checkpoints, tmp_path, content, message):
    folder = copy_of(checkpoints, tmp_path)
    (folder / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        load_model(folder)
    assert '{"model_type": "llama", ...}' in str(err.value)  # what a right file looks like


@pytest.mark.parametrize("model_type", ["gpt2", None])
def test_unsupported_model_type_lists_the_supported_ones(checkpoints, tmp_path, model_type):
    folder = edit_config(copy_of(checkpoints, tmp_path), model_type=model_type)
    with pytest.raises(ValueError, match=rf"model_type {model_type!r} in .*config.json is not "
                       "supported; supported model types: llama, mistral") as err:
        load_model(folder)
    assert all(name in str(err.value) for name in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("family, changes, message", [
    ("llama3", dict(num_attention_heads=0), r"num_attention_heads must be a positive integer "
     r"\(>= 1\), got 0"),
    ("llama3", dict(num_attention_heads=-4), "num_attention_heads must be a positive .*got -4"),
    ("llama3", dict(num_attention_heads="four"), "num_attention_heads must be .*got 'four'"),
    ("llama3", dict(num_hidden_layers=0), "num_hidden_layers must be a positive .*got 0"),
    ("llama3", dict(hidden_size=-64), "hidden_size must be a positive .*got -64"),
    ("llama3", dict(vocab_size=0), "vocab_size must be a positive .*got 0"),
    ("llama3", dict(max_position_embeddings=0), "max_position_embeddings must be .*got 0"),
    ("llama3", dict(intermediate_size=None, num_key_value_heads=0),
     "num_key_value_heads must be a positive .*got 0"),
    ("llama3", dict(head_dim=-16), "head_dim must be a positive .*got -16"),
    ("llama3", dict(hidden_size=True), "hidden_size must be a positive .*got True"),
    ("opt", dict(ffn_dim=0), "ffn_dim must be a positive .*got 0"),
    ("opt", dict(num_attention_heads=0), "num_attention_heads must be a positive .*got 0"),
    # heads must divide hidden_size when head_dim is not given (and always for Llama and OPT)
    ("llama3", dict(num_attention_heads=3, num_key_value_heads=1),
     "hidden_size 64 is not divisible by num_attention_heads 3; .* must divide 64$"),
    ("mistral", dict(head_dim=None, num_attention_heads=3, num_key_value_heads=1),
     r"hidden_size 64 is not divisible by num_attention_heads 3; .* \(or give head_dim\)"),
    ("opt", dict(num_attention_heads=5), "hidden_size 64 is not divisible by num_attention_"),
    ("qwen3", dict(num_key_value_heads=3), "num_attention_heads 4 is not divisible by "
     "num_key_value_heads 3; .* num_key_value_heads must divide 4"),
    ("llama3", dict(num_key_value_heads=8), "num_attention_heads 4 is not divisible by "
     "num_key_value_heads 8"),
])
def test_impossible_config_values(checkpoints, tmp_path, family, changes, message):
    folder = edit_config(copy_of(checkpoints, tmp_path, family), **changes)
    with pytest.raises(ValueError, match=rf"config.json: {message}"):
        load_config(folder)
    with pytest.raises(ValueError, match="config.json: "):
        load_model(folder)


def test_head_dim_frees_qwen3_from_the_division(checkpoints, tmp_path):
    # Qwen3 gives head_dim explicitly (32 here, not 64 / 4): a hidden_size the heads do not
    # divide is a real architecture, not a mistake.
    folder = edit_config(copy_of(checkpoints, tmp_path, "qwen3"), num_attention_heads=3,
                         num_key_value_heads=1)
    cfg = load_config(folder)
    assert (cfg.num_heads, cfg.head_dim, cfg.hidden_size) == (3, 32, 64)


def test_bad_dtype_in_config(checkpoints, tmp_path):
    folder = edit_config(copy_of(checkpoints, tmp_path), dtype="int8")
    with pytest.raises(ValueError, match=r"config.json: dtype torch.int8 is not a floating dtype"):
        load_config(folder)


# ---- the weights --------------------------------------------------------------------------------

def test_tensor_of_the_wrong_shape_is_named_with_both_shapes(checkpoints, tmp_path):
    folder = copy_of(checkpoints, tmp_path)
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' in "
                       r".*model.safetensors has shape \(100, 64\), but the llama model its "
                       r"config describes expects \(128, 64\); config.json and the weights"):
        load_model(folder)
    # build_model on its own (no file known) still names the tensor and both shapes
    cfg = load_config(folder)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape "
                       r"\(100, 64\), but .* expects \(128, 64\)"):
        build_model(cfg, state)


def test_config_that_does_not_describe_the_weights(checkpoints, tmp_path):
    # A valid config of another size: every MLP tensor is the wrong shape; the first is named
    # and the others counted.
    folder = edit_config(copy_of(checkpoints, tmp_path), intermediate_size=96)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.\w+.weight' .* has shape "
                       r"\(\d+, \d+\), but .* expects \((96, 64|64, 96)\) \(5 more tensors "
                       r"differ too\)"):
        load_model(folder)


def test_missing_tensor(checkpoints, tmp_path):
    folder = copy_of(checkpoints, tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint in .*model.safetensors does not match the "
                       r"llama model its config describes: missing \['lm_head.weight'\]"):
        load_model(folder)


@pytest.mark.parametrize("content", [b"garbage bytes, not a safetensors header" * 10, b"",
                                     b"PK\x03\x04 a zip, as torch.save writes"],
                         ids=["garbage", "empty", "pickle"])
def test_weights_file_that_is_not_safetensors(checkpoints, tmp_path, content):
    folder = copy_of(checkpoints, tmp_path)
    (folder / "model.safetensors").write_bytes(content)
    message = r"model.safetensors is not a readable safetensors file \(.*\); it may be truncated"
    with pytest.raises(ValueError, match=message):
        load_model(folder)
    with pytest.raises(ValueError, match=message):
        load_state_dict(folder)


def test_truncated_weights_file(checkpoints, tmp_path):
    folder = copy_of(checkpoints, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_model(folder)


def shard(folder):
    """Split the folder's model.safetensors into two shards and their index."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        file = f"model-0000{i}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_sharded_index_naming_a_missing_shard(checkpoints, tmp_path):
    folder = copy_of(checkpoints, tmp_path)
    index = shard(folder)
    load_model(folder)  # the hand-made shards load while complete
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model.safetensors.index.json names 1 shard\(s\) "
                       r"missing from .*: model-00002-of-00002.safetensors; copy every shard"):
        load_model(folder)
    index.write_text("{oops")
    with pytest.raises(ValueError, match=r"index.json is not valid JSON .*\"weight_map\""):
        load_model(folder)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index.json has no \"weight_map\" object"):
        load_model(folder)
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match=r"names shard '../elsewhere.safetensors'; shards must "
                       "be plain file names"):
        load_model(folder)


def test_no_weights_file(checkpoints, tmp_path):
    folder = copy_of(checkpoints, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has neither model.safetensors nor model.safetensors"
                       r".index.json; save the model with save_pretrained"):
        load_model(folder)
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match=r"found pytorch_model.bin: PyTorch pickles are not read"):
        load_model(folder)


# ---- load_model's arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int8", "banana", "float64", torch.int8, torch.float64, ""])
def test_dtype_must_be_a_supported_float(checkpoints, dtype):
    with pytest.raises(ValueError, match=rf"is not supported; .*choose one of {FLOATS}"):
        load_model(checkpoints["llama"], dtype=dtype)


def test_dtype_names_and_types(checkpoints):
    assert next(load_model(checkpoints["llama"], dtype="torch.bfloat16").parameters()).dtype \
        == torch.bfloat16
    assert next(load_model(checkpoints["opt"], dtype=torch.float16).parameters()).dtype \
        == torch.float16
    with pytest.raises(TypeError, match="dtype must be a name such as 'float16'"):
        load_model(checkpoints["llama"], dtype=16)


def test_device_must_be_a_device(checkpoints):
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device"):
        load_model(checkpoints["llama"], device="gpu")
    with pytest.raises(TypeError, match="device must be a name such as 'cpu'"):
        load_model(checkpoints["llama"], device=0)
