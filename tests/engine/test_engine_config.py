"""EngineArgs -> EngineConfig: every option checked once, before any weight loads; dtype 'auto';
the tier as the model runner the config names."""

import json

import pytest
import torch

from pagedllm import optimized, reference
from pagedllm.reference.engine.config import auto_dtype, resolve_dtype
from pagedllm.reference.engine.validation import FieldTypeError, FieldValueError
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_picks_the_checkpoints_dtype_on_cuda_and_float32_on_the_cpu():
    """vLLM's meaning of --dtype auto, checked without a GPU: the choice is a function of the
    device and the checkpoint's dtype."""
    assert auto_dtype(CUDA, torch.bfloat16) == "bfloat16"
    assert auto_dtype(CUDA, torch.float16) == "float16"
    assert auto_dtype(CUDA, torch.float32) == "float32"
    assert auto_dtype(CPU, torch.bfloat16) == "float32"
    # A packaged GGUF model holds no single dtype: on CUDA it is converted in bfloat16.
    assert resolve_dtype("auto", CUDA, "smollm2-135m-instruct") == "bfloat16"
    assert resolve_dtype("auto", CPU, "smollm2-135m-instruct") == "float32"
    assert resolve_dtype("float16", CUDA, "smollm2-135m-instruct") == "float16"


def test_a_bf16_checkpoint_runs_in_float32_on_the_cpu(tmp_path):
    path = write_random_checkpoint(tmp_path / "bf16", tiny_config("llama"), seed=0)
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["dtype"] = saved["torch_dtype"] = "bfloat16"  # as a bf16 checkpoint says
    config_file.write_text(json.dumps(saved))
    config = reference.EngineArgs(path).create_engine_config()
    assert config.model_config.dtype == torch.bfloat16 and config.dtype == torch.float32
    llm = reference.LLM(path)
    assert next(llm.engine.model.parameters()).dtype == torch.float32


def test_the_config_is_checked_before_the_checkpoint_is_read(tmp_path):
    """A typo fails at once, naming the field, even when the model folder does not exist."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(FieldValueError, match="block_size must be >= 1") as err:
        reference.EngineArgs(missing, block_size=0).create_engine_config()
    assert err.value.field == "block_size"
    with pytest.raises(FieldTypeError, match="seed must be an integer") as err:
        reference.EngineArgs(missing, seed="3").create_engine_config()
    assert err.value.field == "seed"
    with pytest.raises(FieldValueError, match="the optimized tier runs the paged layout only"):
        optimized.EngineArgs(missing, kv_layout="contiguous").create_engine_config()
    with pytest.raises(FieldTypeError, match="model_runner must be a ModelRunner class"):
        reference.EngineArgs(missing, model_runner=print).create_engine_config()


def test_runner_options_are_refused_by_a_runner_without_them(checkpoints):
    with pytest.raises(FieldValueError, match="an option of the optimized tier"):
        reference.LLM(checkpoints["llama"], enforce_eager=True)
    with pytest.raises(FieldValueError, match="gpu_memory_utilization sizes the KV pool"):
        reference.LLM(checkpoints["llama"], gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        optimized.LLM(checkpoints["llama"], gpu_memory_utilization=1.5)


def test_one_engine_the_tier_is_the_runner(checkpoints):
    ref, opt = reference.LLM(checkpoints["llama"]), optimized.LLM(checkpoints["llama"])
    assert type(ref.engine) is type(opt.engine) is reference.LLMEngine
    assert type(ref.engine.runner) is reference.ModelRunner
    assert type(opt.engine.runner) is optimized.ModelRunner
    # The same engine from EngineArgs, as vLLM's LLMEngine.from_engine_args.
    engine = reference.LLMEngine.from_engine_args(optimized.EngineArgs(checkpoints["llama"]))
    assert type(engine.runner) is optimized.ModelRunner


def test_swap_space_in_gib_becomes_blocks(checkpoints):
    config = reference.EngineArgs(checkpoints["llama"], swap_space=0.001, block_size=4,
                                  preemption_mode="swap").create_engine_config()
    per_block = 2 * config.model_config.num_layers * 4 * config.model_config.num_kv_heads \
        * config.model_config.head_dim * 4
    assert config.swap_space_blocks == int(0.001 * 2**30) // per_block > 0
    with pytest.raises(FieldValueError, match="not both"):
        reference.EngineArgs(checkpoints["llama"], swap_space=1,
                             swap_space_blocks=4).create_engine_config()


def test_the_llm_signature_lists_every_option_with_the_tiers_defaults():
    """help(LLM) and editors see EngineArgs' fields; each tier's own default ops."""
    import inspect

    for tier in (reference, optimized):
        params = inspect.signature(tier.LLM).parameters
        assert list(params)[:4] == ["model", "dtype", "device", "block_size"]
        assert params["backend"].default is tier.EngineArgs("any").backend
    assert optimized.EngineArgs("any").backend is None  # chosen for the device by the runner


def test_an_empty_model_name_is_refused_not_read_as_this_folder():
    with pytest.raises(ValueError, match="empty"):
        reference.LLM("")


def test_field_errors_survive_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(FieldValueError("top_p", "top_p must be in (0, 1]")))
    assert err.field == "top_p" and str(err) == "top_p must be in (0, 1]"
    assert pickle.loads(pickle.dumps(FieldTypeError("n", "n must be an integer"))).field == "n"


def test_either_tier_takes_a_whole_engine_args(checkpoints):
    llm = optimized.LLM(optimized.EngineArgs(checkpoints["llama"], block_size=4))
    assert type(llm.engine.runner) is optimized.ModelRunner and llm.engine.config.block_size == 4
    assert llm.engine.config.max_num_seqs == 256  # the scheduler's budgets, read on the config
