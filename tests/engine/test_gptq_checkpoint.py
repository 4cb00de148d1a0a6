"""GPTQ and quantized checkpoints (issue 41: fp8 weights within +1 % of bf16's perplexity).

GPTQ (``model/gptq.py``) keeps round to nearest's grid and scales and chooses each weight's
grid point so the layer's outputs on calibration inputs move least; ``pagedllm quantize``
(``engine/quantize.py``) calibrates on text the model writes itself and saves a checkpoint
whose layers hold the codes (``model/quantized_checkpoint.py``); loading it runs those codes as
they are, on both tiers. What a folder's config cannot be is refused by the field's name."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from pagedllm import optimized, reference
from pagedllm.reference import SamplingParams
from pagedllm.reference.engine.quantize import (
    calibration_hessians,
    calibration_samples,
    quantize_checkpoint,
)
from pagedllm.reference.model.gptq import collect_hessians, gptq_quantize, output_error
from pagedllm.reference.model.quantization import QuantizedLinear
from pagedllm.reference.ops.weight_quant import quantize_fp8, quantize_int8
from pagedllm.serving.cli import main as cli
from pagedllm.serving.default_model import default_model_dir

ROUND = {"fp8": quantize_fp8, "int8": quantize_int8}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The for statement is used to", "Return a list of"]


def correlated_inputs(tokens: int, n: int, seed: int = 0, draw: int = 0) -> torch.Tensor:
    """[tokens, n] inputs whose features correlate and differ in scale, as a layer's do:
    seed fixes how (the mix), draw which rows come out of it."""
    g = torch.Generator().manual_seed(seed)
    mix, scale = torch.randn(n, n, generator=g) / n**0.5, torch.rand(n, generator=g) * 3
    rows = torch.randn(tokens, n, generator=torch.Generator().manual_seed(1000 + draw))
    return rows @ mix * scale


def codes(qw) -> torch.Tensor:
    return qw.qweight.view(torch.uint8) if qw.qweight.dtype == torch.float8_e4m3fn \
        else qw.qweight


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_with_uncorrelated_equal_inputs_gptq_is_round_to_nearest(scheme):
    # H = I: no input's error can be paid back by another, so each weight just rounds
    w = torch.randn(24, 40).bfloat16()
    got, want = gptq_quantize(w, torch.eye(40, dtype=torch.float64), scheme), ROUND[scheme](w)
    assert torch.equal(codes(got), codes(want)) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_gptq_moves_the_outputs_less_than_rounding_each_weight(scheme):
    torch.manual_seed(0)
    w = torch.randn(64, 96).bfloat16()
    x = correlated_inputs(2000, 96)
    H = x.T.double() @ x.double()  # [in, in]
    got, rtn = gptq_quantize(w, H, scheme), ROUND[scheme](w)
    assert torch.equal(got.scales, rtn.scales)  # the same grid: only the codes move
    # measured: 0.36x of round to nearest's output error (fp8 and int8)
    assert output_error(w, got, H) < 0.5 * output_error(w, rtn, H)
    # and on inputs it never saw, drawn the same way (measured 0.38x): not overfitted
    y = correlated_inputs(2000, 96, draw=1)
    Hy = y.T.double() @ y.double()
    assert output_error(w, got, Hy) < 0.6 * output_error(w, rtn, Hy)


@settings(max_examples=25, deadline=None)
@given(out=st.integers(1, 12), n=st.integers(1, 40), dead=st.integers(0, 5),
       block=st.sampled_from([1, 3, 128]), scheme=st.sampled_from(["fp8", "int8"]),
       seed=st.integers(0, 2**16))
def test_any_hessian_gives_finite_codes_on_the_rounding_grid(out, n, dead, block, scheme, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, n, generator=g) * 10.0 ** torch.randint(-3, 2, (out, 1),
                                                                 generator=g)).bfloat16()
    w[0] = 0  # an all-zero row keeps its floored scale
    x = correlated_inputs(3 * n, n, seed)
    x[:, :min(dead, n)] = 0  # inputs that never varied: their columns just round
    got = gptq_quantize(w, x.T.double() @ x.double(), scheme, block_size=block)
    rtn = ROUND[scheme](w)
    assert torch.equal(got.scales, rtn.scales) and got.qweight.shape == (out, n)
    values = got.qweight.float()
    assert torch.isfinite(values).all() and values.abs().max() <= (448 if scheme == "fp8"
                                                                   else 127)
    assert (values[0] == 0).all()


def test_a_wrong_hessian_or_scheme_is_refused_by_name():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"hessian has shape \(4, 4\).*\[8, 8\]"):
        gptq_quantize(w, torch.eye(4), "fp8")
    with pytest.raises(ValueError, match="scheme must be one of.*'int4'"):
        gptq_quantize(w, torch.eye(8), "int4")


def test_hessians_add_up_every_input_row_a_layer_saw():
    layer = torch.nn.Sequential(torch.nn.Linear(5, 3))
    model = torch.nn.Module()  # collect_hessians takes any module holding linears
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(2, 5)
    model.body = layer
    xs = [torch.randn(7, 5), torch.randn(2, 4, 5)]
    H = collect_hessians(model, lambda: [layer(x) for x in xs])
    rows = torch.cat([x.reshape(-1, 5) for x in xs])
    assert set(H) == {"body.0"} and torch.allclose(H["body.0"], rows.T @ rows)
    before = H["body.0"].clone()
    layer(torch.randn(3, 5))  # the hooks are gone once run() returns
    assert torch.equal(H["body.0"], before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model quantized to fp8 by GPTQ on 6 self-written texts of 48 tokens."""
    out = tmp_path_factory.mktemp("gptq") / "tiny-fp8"
    report = quantize_checkpoint(default_model_dir(), out, "fp8", num_samples=6,
                                 num_tokens=48)
    return out, report


def test_the_saved_folder_holds_codes_scales_and_how_they_were_chosen(saved):
    out, report = saved
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "pagedllm" and config["scheme"] == "fp8"
    assert config["method"] == "gptq" and config["calibration_samples"] == 6
    assert report["calibration_tokens"] == 6 * 49
    assert report["gptq_error"] < report["rtn_error"]  # summed over every layer
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (q.shape[0],)
    assert sum(n.endswith(".weight_scale") for n in names) == report["layers"]
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


def test_loading_it_runs_the_saved_codes_as_they_are(saved):
    out, report = saved
    llm = reference.LLM(out, max_model_len=64, num_gpu_blocks=16)
    config = llm.engine.config
    assert config.quantization == "fp8"  # from the folder, without quantization=
    assert config.dtype in (torch.bfloat16, torch.float32)  # auto: a quantized model's
    layers = {n: m for n, m in llm.engine.model.named_modules()
              if isinstance(m, QuantizedLinear)}
    with safe_open(out / "model.safetensors", "pt") as f:
        for name, layer in layers.items():
            assert torch.equal(layer.quantized.qweight.view(torch.uint8),
                               f.get_tensor(name + ".weight").view(torch.uint8)), name
            assert torch.equal(layer.quantized.scales,
                               f.get_tensor(name + ".weight_scale").to(config.dtype)), name
    assert len(layers) == report["layers"]


def test_the_optimized_tier_gives_the_reference_s_tokens_from_the_saved_checkpoint(saved):
    out, _ = saved
    runs = [[o.outputs[0].token_ids for o in make(
        out, dtype="float32", max_model_len=64, num_gpu_blocks=16).generate(
        PROMPTS, GREEDY, use_tqdm=False)] for make in (reference.LLM, optimized.LLM)]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


def test_an_untied_head_is_calibrated_on_every_position(checkpoints):
    """A plain prefill runs the LM head on a prompt's last row only: its Hessian would have
    rank num_samples. Scored at every position, it has as many rows as any layer."""
    llm = reference.LLM(checkpoints["llama"], dtype="bfloat16", max_model_len=64)
    assert not llm.engine.config.model_config.tie_word_embeddings
    samples = calibration_samples(llm, 3, 30)
    H = calibration_hessians(llm, samples)
    hidden = llm.engine.config.model_config.hidden_size
    # the head saw a row per position: full rank, not one row per text
    assert torch.linalg.matrix_rank(H["lm_head"].double()) == hidden > len(samples)
    # q, k and v read one input: the same rows, the same Hessian
    q = H["model.layers.0.self_attn.q_proj"]
    assert torch.equal(q, H["model.layers.0.self_attn.k_proj"])
    assert torch.linalg.matrix_rank(q.double()) == hidden


def test_a_saved_checkpoint_refuses_another_scheme_and_tensor_parallelism(saved):
    out, _ = saved
    with pytest.raises(ValueError, match="quantization 'int8'.*saved quantized"):
        reference.LLM(out, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size 2.*saved quantized"):
        reference.LLM(out, tensor_parallel_size=2)
    assert reference.LLM(out, quantization="fp8", max_model_len=64,
                         num_gpu_blocks=16).engine.config.quantization == "fp8"


def test_a_quantization_config_it_cannot_read_is_refused_by_its_method(saved, tmp_path):
    out, _ = saved
    other = tmp_path / "other"
    shutil.copytree(out, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not read here"):
        reference.LLM(other)


def test_codes_without_their_scales_are_refused_not_read_as_floats(saved, tmp_path):
    out, _ = saved
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    with safe_open(broken / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()
                   if k != "model.layers.0.mlp.up_proj.weight_scale"}
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight holds fp8 codes "
                                         r"but the checkpoint has no .*weight_scale"):
        reference.LLM(broken)


def test_scales_another_dtype_would_round_are_refused(tmp_path):
    out = tmp_path / "tiny-fp8-float32"
    quantize_checkpoint(default_model_dir(), out, "fp8", num_samples=2, num_tokens=8,
                        dtype="float32")
    assert reference.LLM(out, dtype="float32", max_model_len=64,
                         num_gpu_blocks=16).engine.config.quantization == "fp8"
    with pytest.raises(ValueError, match="scales were chosen in another dtype and "
                                         "torch.bfloat16 would round them"):
        reference.LLM(out, dtype="bfloat16")


def test_quantize_refuses_a_full_folder_and_bad_options(saved, tmp_path):
    out, _ = saved
    with pytest.raises(ValueError, match="is saved quantized already.*float checkpoint"):
        quantize_checkpoint(out, tmp_path / "again", num_samples=1, num_tokens=4)
    assert not (tmp_path / "again").exists()
    with pytest.raises(ValueError, match="is not empty"):
        quantize_checkpoint(default_model_dir(), out, num_samples=1, num_tokens=4)
    with pytest.raises(ValueError, match="scheme 'int4'"):
        quantize_checkpoint(default_model_dir(), tmp_path / "a", "int4")
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
        quantize_checkpoint(default_model_dir(), tmp_path / "b", num_tokens=0)
    with pytest.raises(ValueError, match=r"num_tokens 5000: .* give at most \d+"):
        quantize_checkpoint(default_model_dir(), tmp_path / "c", num_tokens=5000)


def test_the_command_writes_an_int8_checkpoint_that_generates(tmp_path, capsys):
    out = tmp_path / "tiny-int8"
    assert cli(["quantize", "--model", str(default_model_dir()), "--scheme", "int8",
                "--output", str(out), "--calibration-samples", "2",
                "--calibration-tokens", "16"]) == 0
    printed = capsys.readouterr().out
    assert "int8" in printed and str(out) in printed
    llm = reference.LLM(out, max_model_len=64, num_gpu_blocks=16)
    assert llm.engine.config.quantization == "int8"
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
    assert cli(["quantize", "--model", str(default_model_dir()), "--output", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
