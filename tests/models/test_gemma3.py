"""Gemma 3 (text) computes what transformers' Gemma3ForCausalLM computes, in both tiers.

The checkpoints are tiny_config("gemma3"): six layers, four of them sliding over a window of 16
and two attending to everything, each kind with its own RoPE base (the global one linearly
scaled). Prompts of 40 tokens and generations past them cross the window, so a layer that read
the wrong keys, or turned them at the wrong base, would change the logits.
"""

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import pagedllm.optimized as optimized
import pagedllm.reference as reference
from pagedllm.optimized.backend import CPU_BACKEND
from pagedllm.optimized.decode_step import DecodeStep
from pagedllm.optimized.layers import merge_projections, transpose_linears
from pagedllm.reference import NoCache, load_config, load_model
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import INIT_STD

LOGIT_TOL = 1e-4  # float32, as tests/models/test_parity.py; measured ~5e-6
# bf16 against transformers' eager attention: measured 0.0 (the same ops in the same order). A
# norm that rounds before it scales (Llama's order), or sqrt(hidden) not rounded to bf16 first,
# differs by ~0.12; sdpa's attention alone by ~0.12 too, hence eager.
BF16_TOL = 0.03
WINDOW = 16
MAX_TOKENS = 24


def randomized(path, std: float = 0.3):
    """The checkpoint with its norm weights and biases drawn from N(0, std): transformers
    writes zeros, which (1 + weight) and a bias turn into no-ops that a mistake in either
    could hide behind."""
    g = torch.Generator().manual_seed(1)
    state = load_file(path / "model.safetensors")
    for name, tensor in state.items():
        if "norm" in name or name.endswith(".bias"):
            state[name] = torch.randn(tensor.shape, generator=g) * std
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> dict:
    """tied: the family's defaults (tied embeddings, zero norms). untied: random norms, and an
    LM head of its own: a random tied model repeats its last token (its embedding rides the
    residual stream and the tied head scores it highest), too weak a check of the cache; this
    one's greedy tokens vary. capped: final_logit_softcapping and q/k/v/o biases."""
    root = tmp_path_factory.mktemp("gemma3")
    configs = {"tied": tiny_config("gemma3"),
               "untied": tiny_config("gemma3", tie_word_embeddings=False),
               "capped": tiny_config("gemma3", final_logit_softcapping=3.0, attention_bias=True),
               # sqrt(48) is not a bf16 number: the embedding scale's rounding shows
               "bf16": tiny_config("gemma3", hidden_size=48, tie_word_embeddings=False)}
    paths = {name: write_random_checkpoint(root / name, config, seed=0, init_std=INIT_STD)
             for name, config in configs.items()}
    for name in ("untied", "capped", "bf16"):
        randomized(paths[name])
    return paths


def hf_model(path, dtype=torch.float32, **kw):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
    model.generation_config.eos_token_id = None  # run the full length, as the engine below
    return model


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_prompt(n, seed=n) for n in (1, 7, 23, 40)]
SHARED = random_prompt(24, seed=99)  # 6 blocks of 4: the prefix cache's hits
PREFIXED = [SHARED + [5, 6, 7], SHARED + [8], SHARED + [9, 10]]


@pytest.fixture(scope="module")
def expected(gemma):
    """transformers' greedy tokens for a prompt, on the untied checkpoint."""
    hf = hf_model(gemma["untied"])

    @functools.cache
    def tokens(prompt: tuple[int, ...]) -> list[int]:
        ids = torch.tensor([prompt])
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                           do_sample=False)[0, len(prompt):].tolist()
    return tokens


def test_the_config_is_read(gemma):
    cfg = load_config(gemma["tied"])
    assert cfg.model_type == "gemma3_text" and cfg.tie_word_embeddings
    assert cfg.sliding_windows == (WINDOW, WINDOW, None) * 2
    assert [theta for theta, _ in cfg.layer_ropes] == [1e4, 1e4, 1e6] * 2
    assert cfg.layer_ropes[2][1] == {"rope_type": "linear", "factor": 8.0}
    assert cfg.query_pre_attn_scalar == 24 and cfg.final_logit_softcapping is None
    assert load_config(gemma["capped"]).final_logit_softcapping == 3.0


# -- the model against transformers -------------------------------------------------------------
@pytest.mark.parametrize("name", ["tied", "untied", "capped"])
def test_logits_match_transformers(gemma, name):
    """The reference model and the optimized tier's merged one, prompts shorter than the
    window and 2.5 windows long."""
    hf = hf_model(gemma[name])
    models = {"reference": load_model(gemma[name]),
              "merged": merge_projections(load_model(gemma[name]))}
    for length in (1, 7, 40):
        ids = torch.tensor(random_prompt(length, seed=length))
        with torch.no_grad():
            want = hf(ids[None]).logits[0]  # [T, vocab]
            for tier, model in models.items():
                diff = (want - model(ids, torch.arange(length), NoCache())).abs().max().item()
                assert diff <= LOGIT_TOL, f"{name}, {tier}, {length} tokens: {diff:.2e}"


def test_bf16_rounds_where_transformers_rounds(gemma):
    path = gemma["bf16"]
    hf = hf_model(path, torch.bfloat16, attn_implementation="eager")
    ref = load_model(path, dtype="bfloat16")
    ids = torch.tensor(random_prompt(40, seed=3))
    with torch.no_grad():
        diff = (hf(ids[None]).logits[0].float()
                - ref(ids, torch.arange(40), NoCache()).float()).abs().max().item()
    assert diff <= BF16_TOL


# -- the engine, both tiers ---------------------------------------------------------------------
def greedy(tier):
    return tier.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm, tier, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tier),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(llm):
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and stats["swapped_blocks"] == 0


ROOMY, TIGHT = 192, 48  # blocks of 4: every prompt at once, or too few for the batch
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=16)
OPTIONS = {
    "plain": dict(num_gpu_blocks=ROOMY),
    "chunked": dict(num_gpu_blocks=ROOMY, **CHUNKED),
    "swap": dict(num_gpu_blocks=TIGHT, preemption_mode="swap", swap_space_blocks=96),
    "recompute": dict(num_gpu_blocks=TIGHT, preemption_mode="recompute"),
    "chunked-swap": dict(num_gpu_blocks=TIGHT, preemption_mode="swap", swap_space_blocks=96,
                         **CHUNKED),
}


@pytest.mark.parametrize("option", OPTIONS)
def test_greedy_tokens_match_transformers(tier, gemma, expected, option):
    """Four prompts batched (1 to 40 tokens, 24 new each); chunked prefill in chunks of 16;
    a pool too small for the batch, preempting by swap or by recompute."""
    llm = tier.LLM(gemma["untied"], block_size=4, **OPTIONS[option])
    assert generate(llm, tier, PROMPTS) == [expected(tuple(p)) for p in PROMPTS]
    stats, mode = llm.stats(), OPTIONS[option].get("preemption_mode")
    preempted = (stats["preemptions_swap"] > 0, stats["preemptions_recompute"] > 0)
    assert preempted == (mode == "swap", mode == "recompute")  # the tight pool did preempt
    assert_no_leak(llm)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prefix_caching_keeps_the_tokens(tier, gemma, expected, chunked):
    """Prompts sharing 24 tokens (more than the window), run once to fill the cache and again
    to hit it: the hits serve every layer kind the keys it would have computed."""
    llm = tier.LLM(gemma["untied"], block_size=4, num_gpu_blocks=ROOMY,
                   enable_prefix_caching=True, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=16 if chunked else None)
    want = [expected(tuple(p)) for p in PREFIXED]
    assert generate(llm, tier, PREFIXED[:1]) == want[:1]
    assert generate(llm, tier, PREFIXED) == want
    assert llm.stats()["prefix_cache_hit_blocks"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("draft", ["ngram", "mistral", "gemma3"])
def test_speculative_decoding_keeps_the_tokens(tier, gemma, checkpoints, expected, draft):
    """Verification runs several rows a sequence through both layer kinds; greedy tokens stay
    transformers'. Proposals by n-gram lookup, a Mistral draft model, or Gemma 3 itself."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3} \
        if draft == "ngram" else {"model": str(gemma["untied"] if draft == "gemma3"
                                               else checkpoints[draft]),
                                  "num_speculative_tokens": 3}
    prompts = [*PROMPTS, [3, 4, 5, 6] * 8]  # repeats: the n-gram lookup finds proposals
    llm = tier.LLM(gemma["untied"], block_size=4, num_gpu_blocks=ROOMY, speculative_config=spec)
    assert generate(llm, tier, prompts) == [expected(tuple(p)) for p in prompts]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_the_reference_baselines_keep_the_tokens(gemma, expected, batching):
    """The reference tier's contiguous slabs, with continuous or static batching."""
    llm = reference.LLM(gemma["untied"], kv_layout="contiguous", batching=batching,
                        num_gpu_blocks=400)
    assert generate(llm, reference, PROMPTS) == [expected(tuple(p)) for p in PROMPTS]


def test_int8_weights_run_in_both_tiers(gemma):
    """quantization="int8" quantizes every projection of Gemma 3 (its norms and embedding stay
    float) in both tiers. A quantized model runs in bf16 by default, where the tiers add in
    different orders: greedy tokens may part at a near-tie, and at the first difference each
    tier's token must be in the other's top 5 within 0.1 nats (test_weight_quant.py's check)."""
    params = reference.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      logprobs=5)
    outs = []
    for tier in (reference, optimized):
        llm = tier.LLM(gemma["untied"], block_size=4, num_gpu_blocks=ROOMY, quantization="int8")
        stats = llm.stats()
        assert stats["quantization"] == "int8" and stats["float_linears"] == []
        outs.append([o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)])
    for ref, opt in zip(*outs, strict=True):
        pairs = zip(ref.token_ids, opt.token_ids, strict=True)
        diverged = [i for i, (a, b) in enumerate(pairs) if a != b]
        if diverged:
            i = diverged[0]
            a, b = ref.token_ids[i], opt.token_ids[i]
            assert b in ref.logprobs[i] and a in opt.logprobs[i]
            assert ref.logprobs[i][a] - ref.logprobs[i][b] < 0.1


def test_two_tensor_parallel_ranks_give_transformers_tokens(tier, gemma, expected):
    """tensor_parallel_size=2 (gloo): each rank one KV head, q/k norms replicated, the scaled
    embedding assembled before the layers."""
    with tier.LLM(gemma["untied"], block_size=4, num_gpu_blocks=ROOMY,
                  tensor_parallel_size=2) as llm:
        tokens = generate(llm, tier, PROMPTS)
    assert tokens == [expected(tuple(p)) for p in PROMPTS]


def test_the_llama_decode_step_leaves_gemma_to_its_modules(gemma):
    """The CPU's one-call decode step strings Llama's layers together; Gemma 3's layers run
    their own modules (its sandwich norms and GeGLU are not in that stack)."""
    model = transpose_linears(merge_projections(load_model(gemma["untied"])))
    assert DecodeStep.build(model, CPU_BACKEND, torch.float32) is None
    llm = optimized.LLM(gemma["untied"], block_size=4, num_gpu_blocks=ROOMY)
    assert llm.kernels()["whole_step"].startswith("none")


# -- what is refused, by name -------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("attn_logit_softcapping", 50.0),
    ("use_bidirectional_attention", True),
    ("hidden_activation", "gelu"),
    ("final_logit_softcapping", -1.0),
    ("query_pre_attn_scalar", 0),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                            "rope_theta": 1e6}}),
])
def test_what_the_model_does_not_run_is_refused_by_name(tier, gemma, tmp_path, field,
                                                        value):
    path = tmp_path / "gemma3"
    shutil.copytree(gemma["tied"], path)
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        tier.LLM(path, block_size=4, num_gpu_blocks=64)
