"""Adversarial checks of model names, GGUF conversion and chat prompts.

A tiny but complete llama GGUF (metadata, byte-level tokenizer, chat template, float tensors with
llama.cpp's q/k row permutation) is written with the `gguf` package's writer from a random
checkpoint; converting it must give back the very tensors, and the same tokens.
"""

import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

import pagedllm.reference.model.gguf as gguf_module
from pagedllm.reference import LLM, SamplingParams
from pagedllm.reference.model import registry
from pagedllm.reference.model.gguf import convert_gguf, is_converted_from
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.model.registry import resolve_model

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert script's reordering of q/k rows (transformers undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_llama_gguf(hf_dir, path) -> None:
    """The GGUF file llama.cpp would write for the float32 llama checkpoint in hf_dir."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens = sorted(vocab["model"]["vocab"], key=vocab["model"]["vocab"].get)
    tokens += [t["content"] for t in vocab["added_tokens"]]  # EOS, id 256
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3])
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_eos_token_id(256)
    w.add_bos_token_id(256)
    w.add_chat_template(TEMPLATE)
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(cfg["num_hidden_layers"]):
        for short, long in names.items():
            t = sd[f"model.layers.{i}.{long}.weight"]
            if short in ("attn_q", "attn_k"):
                t = _permute(t, heads if short == "attn_q" else kv_heads)
            w.add_tensor(f"blk.{i}.{short}.weight", t.numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed in (0, 1):  # GQA (4 query / 2 KV heads): the k permutation uses the KV count
        hf = write_random_checkpoint(root / f"hf{seed}", tiny_config(
            "llama", num_key_value_heads=2), seed=seed, init_std=0.2)
        folder = root / f"a folder ü {seed}"  # spaces and non-ASCII in the path
        folder.mkdir()
        write_llama_gguf(hf, folder / "tïny model.gguf")
        out[seed] = (hf, folder / "tïny model.gguf")
    assert out[0][1].stat().st_size == out[1][1].stat().st_size  # same size, other weights
    return out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def greedy(model, **kw):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1)
    out = LLM(model, **kw).generate({"prompt_token_ids": list(range(40, 70))}, params,
                                    use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.cumulative_logprob


def test_a_complete_gguf_converts_to_the_tensors_written(files, monkeypatch):
    hf, gguf_file = files[0]
    folder = resolve_model(gguf_file)
    written, converted = load_file(str(hf / "model.safetensors")), load_file(
        str(folder / "model.safetensors"))
    assert set(converted) == set(written)
    assert all(torch.equal(converted[k], written[k]) for k in written)  # q/k un-permuted
    assert greedy(folder) == greedy(hf)
    monkeypatch.chdir(gguf_file.parent)  # the same file by a relative path, or a symlink
    assert resolve_model(gguf_file.name) == folder
    os.symlink(gguf_file, gguf_file.parent.parent / "link.gguf")
    assert resolve_model(gguf_file.parent.parent / "link.gguf") == folder
    assert resolve_model(gguf_file.parent) == folder  # the folder holding it


def test_a_gguf_replaced_by_another_of_the_same_size_is_converted_again(files, tmp_path):
    gguf_file = tmp_path / "model.gguf"
    shutil.copy(files[0][1], gguf_file)
    first = greedy(gguf_file)
    shutil.copy(files[1][1], gguf_file)  # same path, same size, different weights
    assert greedy(gguf_file) == greedy(files[1][0])
    assert first == greedy(files[0][0])


def test_two_conversions_of_one_file_at_once_both_succeed(files, tmp_path, monkeypatch):
    """While one conversion writes its weights, another (a second process) converts the same
    file to the same folder: they used to share one `.partial` folder and break each other."""
    gguf_file, out = files[0][1], tmp_path / "out"
    real_save, nested = gguf_module.save_file, []

    def save_while_another_converts(tensors, path, **kw):
        if not nested:
            nested.append("started")
            nested[0] = convert_gguf(gguf_file, out)  # the other process, start to end
        real_save(tensors, path, **kw)

    monkeypatch.setattr(gguf_module, "save_file", save_while_another_converts)
    assert convert_gguf(gguf_file, out) == out
    assert is_converted_from(out, gguf_file) and nested == [out]
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_an_old_partial_folder_is_cleaned_and_a_cache_path_that_is_a_file_is_named(
        files, cache, monkeypatch, tmp_path):
    gguf_file = files[0][1]
    stale = cache / "gguf" / f"{gguf_file.stem}-float32.partial"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))  # left by a conversion killed long ago
    resolve_model(gguf_file)
    assert not stale.exists()
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path / "a file"))
    with pytest.raises(ValueError, match="PAGEDLLM_CACHE"):
        resolve_model(gguf_file)


def test_dtype_as_a_string_or_a_torch_dtype_and_nothing_else(files):
    hf, gguf_file = files[0]
    folder = LLM(gguf_file, dtype=torch.float16).model_dir
    assert folder == LLM(gguf_file, dtype="float16").model_dir
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    for bad in ("int8", "auto", "float64"):  # resolve_model used to convert to int8
        with pytest.raises(ValueError, match="is not supported; choose one of"):
            resolve_model(gguf_file, bad)
    assert resolve_model(hf) == hf  # an ordinary folder is returned as it is


def test_a_known_name_typed_with_capitals_or_spaces(files, monkeypatch):
    monkeypatch.setattr(registry, "packaged_gguf", lambda name: files[0][1])
    expected = resolve_model("smollm2-135m-instruct")
    assert resolve_model("SmolLM2-135M-Instruct ") == expected


# -- chat --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_llm(files, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE", str(tmp_path_factory.mktemp("chat-cache")))
        return LLM(files[0][1])


def prompts_of(outs):
    return [o.prompt for o in outs]


def test_chat_forms(chat_llm):
    p = SamplingParams(max_tokens=2)
    hi = [{"role": "user", "content": "hi"}]
    assert prompts_of(chat_llm.chat(hi, p, use_tqdm=False)) == ["<user>hi\n<assistant>"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # OpenAI's parts
    assert prompts_of(chat_llm.chat(parts, p, use_tqdm=False)) == ["<user>hi\n<assistant>"]
    two = chat_llm.chat([hi, [{"role": "user", "content": "yo"}]], p, use_tqdm=False)
    assert prompts_of(two) == ["<user>hi\n<assistant>", "<user>yo\n<assistant>"]
    no_gen = chat_llm.chat(hi, p, use_tqdm=False, add_generation_prompt=False)
    assert prompts_of(no_gen) == ["<user>hi\n"]
    override = chat_llm.chat(hi, p, use_tqdm=False, chat_template="[{{ messages[0].content }}]")
    assert prompts_of(override) == ["[hi]"]
    for bad in ([], [[]], "hi", None, [{"role": "user"}], [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]):
        with pytest.raises(ValueError, match="messages"):
            chat_llm.chat(bad, p, use_tqdm=False)
    assert not chat_llm.engine.groups


@pytest.mark.parametrize("template", [
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}",  # refuses
    "{% for %}",  # does not parse
    "{{ foo.bar }}",  # reads something undefined
])
def test_a_template_that_fails_is_a_value_error(chat_llm, template):
    with pytest.raises(ValueError, match="chat template failed"):
        chat_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                      use_tqdm=False, chat_template=template)
    assert not chat_llm.engine.groups
