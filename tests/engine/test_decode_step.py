"""The optimized tier's decode step in one C++ call (``optimized/decode_step.py``) gives what
the modules give, bit for bit: the same kernels in the same order. ``enforce_eager=True`` runs
the modules (as it turns CUDA graphs off on a GPU), so the two runs are compared on greedy and
seeded random tokens and on their logprobs, over models that exercise what the stack reads:
multi-head and grouped-query attention, a sliding window, biases on Q/K/V with a tied head,
and each kind of product (bf16, int8, int4, fp8; in a float32 model ATen's dense product and
int8, int4, fp8), with preemption and block reuse in the run, and a float32 model on every
instruction-set path this machine has.
"""

from dataclasses import replace

import pytest
import torch

from pagedllm import optimized
from pagedllm.kernels.cpu_ops import FLOATS, ISAS, cpu_kernels, use_isa
from pagedllm.optimized.backend import CPU_BACKEND
from pagedllm.optimized.decode_step import PACKED
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels() is None,
                                reason="the CPU kernels did not build: the stack is not used")

# head_dim 32 (64 / 2 heads): the decode kernel takes 32 or 64
FAMILIES = {
    "llama": dict(num_attention_heads=2, num_key_value_heads=2),  # multi-head
    "llama3": dict(num_attention_heads=2, num_key_value_heads=1),  # GQA, llama3 rope
    "mistral": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),  # window 16
    "qwen2": dict(num_attention_heads=2, num_key_value_heads=1),  # qkv bias, tied head
}
WEIGHTS = {"bf16": dict(dtype="bfloat16"), "int8": dict(quantization="int8"),
           "int4": dict(quantization="int4", quantization_group_size=32),
           "fp32": dict(dtype="float32"),
           "int8-fp32": dict(dtype="float32", quantization="int8"),
           "int4-fp32": dict(dtype="float32", quantization="int4", quantization_group_size=32),
           "fp8": dict(quantization="fp8"), "fp8-fp32": dict(dtype="float32", quantization="fp8")}


def _skip_unless_the_stack_can_run(llm, weights):
    """A float32 model runs the stack where the CPU ops run their kernels in float32 and its
    quantized products are on our kernels (quant_layers.py); elsewhere the modules run it."""
    if weights.endswith("fp32") and torch.float32 not in FLOATS:
        pytest.skip("the CPU ops run their kernels in bf16 only")
    layer = llm.engine.runner.model.model.layers[0]
    if "quantization" in WEIGHTS[weights] and not isinstance(layer.mlp.down_proj, PACKED):
        pytest.skip(f"{weights}: the products are not on our kernels")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_step")
    made = {family: write_random_checkpoint(root / family, tiny_config(family, **extra),
                                            seed=1, init_std=0.2)
            for family, extra in FAMILIES.items()}
    made["qwen3"] = write_random_checkpoint(root / "qwen3", tiny_config("qwen3"), seed=1,
                                            init_std=0.2)
    return made


def _run(path, enforce_eager, **options):
    # 20 blocks of 4 for 6 sequences of 28 to 53 tokens: preemption, then the blocks reused
    llm = optimized.LLM(path, block_size=4, num_gpu_blocks=20, max_num_seqs=6,
                        enforce_eager=enforce_eager, **options)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 1 for j in range(4 + 5 * i)]}
               for i in range(6)]  # 4..29 tokens: some past the window of 16
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True,
                             logprobs=3)]
    outs = llm.generate(prompts, [params[i % 2] for i in range(6)], use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_stack_gives_the_modules_results_bit_for_bit(paths, family, weights):
    fused, fused_out = _run(paths[family], False, **WEIGHTS[weights])
    _skip_unless_the_stack_can_run(fused, weights)
    eager, eager_out = _run(paths[family], True, **WEIGHTS[weights])
    assert fused.engine.runner.whole_step is not None  # the stack ran the decode steps
    assert eager.engine.runner.whole_step is None
    assert fused.stats()["preemptions_recompute"] + fused.stats()["preemptions_swap"] > 0
    assert fused_out == eager_out  # tokens and logprobs, exactly


@pytest.mark.parametrize("isa", ISAS)
def test_the_stack_gives_the_modules_results_on_every_path(paths, isa):
    """A float32 model (ATen's products, our small kernels and attention) on each
    instruction-set path: the stack and the modules take the same path, with the same
    results."""
    with use_isa(isa):
        fused, fused_out = _run(paths["llama3"], False, dtype="float32")
        _skip_unless_the_stack_can_run(fused, "fp32")
        _, eager_out = _run(paths["llama3"], True, dtype="float32")
    assert fused.engine.runner.whole_step is not None
    assert fused_out == eager_out


@pytest.mark.parametrize("case, options", [
    ("q/k norms (qwen3)", dict(path="qwen3", dtype="bfloat16")),
    ("float16", dict(path="llama", dtype="float16")),
    ("a swapped op", dict(path="llama", dtype="bfloat16", backend=replace(
        CPU_BACKEND, rms_norm=lambda *a, **k: CPU_BACKEND.rms_norm(*a, **k)))),
])
def test_what_the_stack_cannot_run_runs_the_modules(paths, case, options):
    options = dict(options)
    path = paths[options.pop("path")]
    llm = optimized.LLM(path, **options)
    assert llm.engine.runner.whole_step is None, case
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], params,
                            use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_a_quantized_cache_runs_the_modules_for_its_steps(paths):
    """fp8 K/V: the stack is built but reads only an unquantized cache, so every step runs
    the modules; results equal the eager run's."""
    fused, fused_out = _run(paths["llama3"], False, dtype="bfloat16", kv_cache_dtype="fp8")
    _, eager_out = _run(paths["llama3"], True, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fused_out == eager_out


def test_a_step_the_stack_refuses_ends_its_requests_and_leaves_the_engine_usable(paths):
    """A kernel inside the one C++ call refuses what it cannot index (here a K/V slot outside
    the cache, planted by a step observer in the third decode step): the step's requests end
    with the error, their blocks are freed, nothing was written, and the engine runs the next
    requests as a fresh engine does."""
    llm = optimized.LLM(paths["llama3"], dtype="bfloat16", block_size=4)
    assert llm.engine.runner.whole_step is not None
    prompts = [{"prompt_token_ids": [3 + i, 9, 27, 4 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    steps = {"decode": 0}

    def plant(engine, sched, inputs):
        md = inputs.attn_metadata
        if inputs.input_ids.shape[0] == md.seq_lens.shape[0]:  # decodes only
            steps["decode"] += 1
            if steps["decode"] == 3:
                md.slot_mapping[0] = 10**9

    llm.engine.add_step_observer(plant)
    with pytest.raises(RuntimeError, match="outside the cache"):
        llm.generate(prompts, params, use_tqdm=False)
    llm.engine.step_observers.remove(plant)
    assert llm.stats()["blocks_used"] == 0 and not llm.engine.has_unfinished_requests()
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    fresh = optimized.LLM(paths["llama3"], dtype="bfloat16", block_size=4)
    assert again == [o.outputs[0].token_ids for o in fresh.generate(prompts, params,
                                                                     use_tqdm=False)]


def test_speculative_runs_take_the_one_call_with_plain_decodings_tokens(paths):
    """A speculative step's rows (each sequence's last token and its proposals) run through
    the stack as one query a row; the tokens are plain decoding's, every step after the
    prompts is one call (torch.profiler sees its label), and proposals were verified."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [9, 3] * 9}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = optimized.LLM(paths["llama3"], block_size=4, dtype="float32")
    _skip_unless_the_stack_can_run(plain, "fp32")
    want = plain.generate(prompts, params, use_tqdm=False)
    spec = optimized.LLM(paths["llama3"], block_size=4, dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = spec.generate(prompts, params, use_tqdm=False)
    calls = sum(e.count for e in prof.key_averages() if e.key == "pagedllm::decode_layers")
    assert spec.stats()["spec_decode_num_drafts"] > 0
    assert calls == spec.engine.num_steps - 1  # every step but the one of both prompts
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
