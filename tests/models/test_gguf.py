"""GGUF files and model names refused with one clear line: missing, corrupt, an unsupported tensor
type, an unknown name. The files are written here with the `gguf` package's own writer."""

import gguf
import numpy as np
import pytest

from pagedllm.reference import LLM
from pagedllm.reference.model.gguf import SUPPORTED_TENSOR_TYPES, check_tensor_types, find_gguf
from pagedllm.serving.cli import main


def write_gguf(path, tensors: dict) -> None:
    """A GGUF file holding the given tensors: name -> (numpy array, GGML type or None)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def run_cli(args, capsys) -> tuple[int, list[str]]:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.fixture
def k_quant_file(tmp_path):
    path = tmp_path / "kquant.gguf"
    write_gguf(path, {
        "token_embd.weight": (np.ones((4, 8), dtype=np.float32), None),
        # Q4_K (llama.cpp's k-quants): 256 weights in a 144-byte block.
        "blk.0.attn_q.weight": (np.zeros((4, 144), dtype=np.uint8),
                                gguf.GGMLQuantizationType.Q4_K),
    })
    return path


def test_an_unsupported_tensor_type_is_named(k_quant_file):
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has type Q4_K") as err:
        check_tensor_types(k_quant_file)
    assert all(t in str(err.value) for t in SUPPORTED_TENSOR_TYPES)


def test_the_cli_says_it_in_one_line(k_quant_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    code, err = run_cli(["generate", "--model", str(k_quant_file), "--prompt", "hi"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "Q4_K" in err[0]
    assert not (tmp_path / "cache" / "gguf" / "kquant-float32").exists()  # nothing half-made


def test_a_truncated_file_is_refused(k_quant_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(k_quant_file.read_bytes()[:100])
    code, err = run_cli(["generate", "--model", str(truncated), "--prompt", "hi"], capsys)
    assert code == 2 and len(err) == 1
    assert "not a readable GGUF file" in err[0] and "truncated" in err[0]


def test_a_missing_file_and_an_unknown_name_are_refused(tmp_path, capsys):
    code, err = run_cli(["generate", "--model", str(tmp_path / "nothing.gguf"), "--prompt",
                         "hi"], capsys)
    assert code == 2 and len(err) == 1 and "nothing.gguf" in err[0]
    code, err = run_cli(["chat", "--model", "smollm2-135m"], capsys)
    assert code == 2 and len(err) == 1
    assert "neither a folder nor a known model name" in err[0]
    assert "smollm2-135m-instruct" in err[0]  # the names it does know
    with pytest.raises(ValueError, match="known names"):
        LLM("llama-13b-please")


def test_a_folder_with_two_gguf_files_asks_which(tmp_path, k_quant_file):
    (tmp_path / "copy.gguf").write_bytes(k_quant_file.read_bytes())
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        find_gguf(tmp_path)
    assert find_gguf(k_quant_file) == k_quant_file
