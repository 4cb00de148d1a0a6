"""The reference model computes what Hugging Face transformers computes, for every family."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.reference import NoCache, generate, load_config, load_model
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import FAMILIES, INIT_STD

LOGIT_TOL = 1e-4  # max abs difference, float32; measured ~2e-5 at INIT_STD = 0.2
PROMPT_LENGTHS = (1, 7, 40)  # 40 > the Mistral checkpoint's sliding window of 16


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, as generate() below does
    return model


def random_prompt(length: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    ref, hf = load_model(checkpoints[family]), hf_model(checkpoints[family])
    for length in PROMPT_LENGTHS:
        ids = random_prompt(length, ref.config.vocab_size, seed=length)
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]  # [T, vocab]
            got = ref(ids, torch.arange(length), NoCache())  # [T, vocab]
        diff = (expected - got).abs().max().item()
        print(f"{family:8s} {length:3d} tokens: max |logit diff| vs transformers = {diff:.2e}")
        assert diff <= LOGIT_TOL, f"{family}, {length} tokens: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(checkpoints, family):
    ref, hf = load_model(checkpoints[family]), hf_model(checkpoints[family])
    ids = random_prompt(9, ref.config.vocab_size, seed=1)
    expected = hf.generate(ids[None], attention_mask=torch.ones(1, 9, dtype=torch.long),
                           max_new_tokens=32, do_sample=False)[0, 9:].tolist()
    assert generate(ref, ids.tolist(), 32) == expected


def test_family_switches_are_read(checkpoints):
    """The tiny checkpoints really exercise what distinguishes each family."""
    cfg = {f: load_config(checkpoints[f]) for f in FAMILIES}
    assert cfg["llama3"].num_kv_heads < cfg["llama3"].num_heads  # GQA
    assert cfg["llama3"].rope_scaling["rope_type"] == "llama3"
    assert cfg["mistral"].sliding_windows == (16, 16)
    assert cfg["qwen2"].attention_bias and cfg["qwen2"].tie_word_embeddings
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim * cfg["qwen3"].num_heads != 64
    assert cfg["opt"].is_opt and cfg["opt"].num_kv_heads == cfg["opt"].num_heads


def test_sharded_checkpoint_loads(tmp_path):
    path = write_random_checkpoint(tmp_path / "sharded", tiny_config("llama3"), seed=3,
                                   init_std=INIT_STD, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file()
    ids = random_prompt(12, 257, seed=2)
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0]
        got = load_model(path)(ids, torch.arange(12), NoCache())
    assert (expected - got).abs().max().item() <= LOGIT_TOL


def test_post_layer_norm_opt_matches(tmp_path):
    """OPT-350m style: LayerNorm after each block, embeddings projected in and out."""
    config = tiny_config("opt", do_layer_norm_before=False, word_embed_proj_dim=32)
    path = write_random_checkpoint(tmp_path / "opt350", config, seed=4, init_std=INIT_STD)
    ids = random_prompt(10, 257, seed=4)
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0]
        got = load_model(path)(ids, torch.arange(10), NoCache())
    assert (expected - got).abs().max().item() <= LOGIT_TOL
