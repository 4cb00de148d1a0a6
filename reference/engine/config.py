"""The engine's configuration: every option in one dataclass, checked once, before any weight
loads (vLLM's ``EngineArgs`` -> ``create_engine_config()``; nano-vllm's ``Config``).

``EngineArgs`` holds what a user hands ``LLM(...)``, the CLI or the server, as given.
``create_engine_config()`` checks every field, resolves what depends on the checkpoint (the
dtype ``auto`` picks, ``max_model_len`` from the model's positions, the KV pool's size from a
memory budget) and returns an ``EngineConfig``. Nothing downstream checks an option again: the
engine, the scheduler, the KV manager and the model runner trust what they are handed.

A wrong type is a TypeError, a value out of range a ValueError; each names the field (the
``.field`` of ``FieldValueError`` / ``FieldTypeError``) and says what would be right.
"""

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..kv_size import kv_size
from ..model import load_config, resolve_model
from ..model.config import ModelConfig
from ..model.gguf import converted_from
from ..model.loader import ARCHITECTURES, parse_device
from ..model.quantization import check_skip
from ..model.registry import FLOAT_DTYPES, MODELS, find_gguf
from ..model.tensor_parallel import attention_heads, check_tensor_parallel_size
from ..ops import KV_CACHE_DTYPES, REFERENCE_BACKEND, Backend, KVCacheFormat, kv_cache_format
from ..ops.weight_quant import INT4_GROUP_SIZES, WEIGHT_QUANTIZATIONS
from ..spec_decode.config import SpeculativeConfig, check_speculative_config
from .model_runner import ModelRunner
from .scheduler import SchedulerConfig
from .validation import (
    FieldTypeError,
    FieldValueError,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_names,
)

KV_LAYOUTS = ("paged", "contiguous")
POLICIES = ("max", "pow2", "oracle")
DEFAULT_KV_CACHE_MEMORY = 256 * 2**20  # bytes, when neither num_gpu_blocks nor memory is given
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's, for a runner that profiles its KV pool


# --8<-- [start:engine_args]
@dataclass
class EngineArgs:
    """Every option of the engine, as the user gives it (vLLM's names)."""

    model: str | Path
    dtype: str | torch.dtype = "auto"  # auto: the checkpoint's on CUDA, float32 on the CPU
    device: str | torch.device = "cpu"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: as many as kv_cache_memory buys (or profiling)
    kv_cache_memory: int | None = None  # bytes
    swap_space_blocks: int = 0
    kv_layout: str = "paged"  # or "contiguous" (the paper's baseline)
    reservation_policy: str = "max"  # contiguous slabs: "max" | "pow2" | "oracle"
    batching: str = "continuous"  # or "static" (the traditional baseline)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's default, a whole prompt per step
    max_model_len: int | None = None  # None: the model's positions
    preemption_mode: str = "recompute"  # or "swap"
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    seed: int = 0
    # the ops: None is the tier's own for the device; a Backend (one swapped for a test)
    backend: Backend | None = REFERENCE_BACKEND
    model_runner: type[ModelRunner] = ModelRunner  # the tier: who executes the model
    enforce_eager: bool = False  # a runner that captures CUDA graphs (or its CPU stack): don't
    gpu_memory_utilization: float | None = None  # a runner that profiles: share of the GPU
    swap_space: float = 0  # GiB of CPU swap space (vLLM's flag), instead of swap_space_blocks
    kv_cache_dtype: str = "auto"  # "fp8" (= "fp8_e4m3"), "fp8_e5m2", "int8", "int4"
    calculate_kv_scales: bool = False  # fp8: per-tensor scales from the first batch, not 1.0
    quantization: str | None = None  # weights: "int8" (per output channel), "int4" (per group)
    quantization_group_size: int = 32  # int4: inputs per group (32, 64, 128 or 256)
    # linear layers left unquantized, e.g. ("lm_head",) or ("mlp.down_proj",): each entry the
    # full module name or a run of its dot-separated parts (model/quantization.py:skip_matches)
    quantization_skip: tuple[str, ...] | None = ()
    tensor_parallel_size: int = 1  # ranks splitting every layer (torch.distributed workers)
    pipeline_parallel_size: int = 1  # vLLM's flag; only 1: layers are split by tensor parallelism
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1: no cap
    # speculative decoding (spec_decode/config.py): {"method": "ngram", ...} or {"model": ...}
    speculative_config: dict | str | SpeculativeConfig | None = None
# --8<-- [end:engine_args]

    def create_engine_config(self) -> "EngineConfig":
        return create_engine_config(self)


@dataclass(frozen=True)
class EngineConfig:
    """The checked, resolved configuration the engine is built from."""

    model_dir: Path
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    block_size: int
    num_gpu_blocks: int | None  # None: the runner profiles the pool (gpu_memory_utilization)
    swap_space_blocks: int
    kv_layout: str
    reservation_policy: str
    enable_prefix_caching: bool
    scheduler_config: SchedulerConfig
    seed: int
    backend: Backend | None  # None: the runner takes its tier's own for the device
    model_runner: type[ModelRunner]
    enforce_eager: bool
    gpu_memory_utilization: float
    kv_cache_dtype: str  # the canonical name (ops/kv_quant.py): auto, fp8_e4m3, fp8_e5m2, ...
    calculate_kv_scales: bool
    quantization: str | None = None
    quantization_group_size: int = 32
    quantization_skip: tuple[str, ...] = ()
    tensor_parallel_size: int = 1
    max_logprobs: int = 20  # -1: no cap but the vocabulary (request_checks.py)
    speculative_config: SpeculativeConfig | None = None  # checked; a draft's folder resolved

    # The scheduler's budgets, read where the engine's config is read (engine.config.X).
    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler_config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler_config.max_num_batched_tokens

    @property
    def preemption_mode(self) -> str:
        return self.scheduler_config.preemption_mode

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.scheduler_config.enable_chunked_prefill

    @property
    def batching(self) -> str:
        return self.scheduler_config.batching


# --8<-- [start:create_engine_config]
def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Check every option (cheap ones first: a typo fails before a file is read), then read the
    checkpoint's config and resolve what depends on it."""
    device = parse_device(args.device)
    dtype_name = _dtype_name(args.dtype)
    check_int("seed", args.seed, low=0, high=2**64 - 1)  # the range of a request's seed
    _check_backend(args.backend)
    runner = args.model_runner
    if not (isinstance(runner, type) and issubclass(runner, ModelRunner)):
        raise FieldTypeError("model_runner", f"model_runner must be a ModelRunner class, got "
                             f"{runner!r}")
    check_choice("kv_layout", args.kv_layout, KV_LAYOUTS)
    if args.reservation_policy not in POLICIES:
        raise FieldValueError("reservation_policy", f"reservation policy "
                              f"{args.reservation_policy!r} is unknown; choose one of {POLICIES}")
    if args.preemption_mode not in ("recompute", "swap"):
        raise FieldValueError("preemption_mode", f"preemption_mode {args.preemption_mode!r} is "
                              "unknown; choose 'recompute' or 'swap'")
    if args.batching not in ("continuous", "static"):
        raise FieldValueError("batching", f"batching {args.batching!r} is unknown; choose "
                              "'continuous' or 'static'")
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                 "calculate_kv_scales"):
        check_bool(name, getattr(args, name))
    kv_format = _kv_cache_format(args)
    quant_skip = _check_quantization(args)
    if dtype_name == "auto" and args.quantization is not None:
        dtype_name = auto_quantized_dtype(device)
    _check_tier_options(args, runner)
    spec = _check_speculation(args)
    check_int("block_size", args.block_size, low=1)
    _check_tensor_parallel(args, device)
    _check_pipeline_parallel(args)
    check_int("swap_space_blocks", args.swap_space_blocks, low=0)
    check_float("swap_space", args.swap_space, 0.0)
    if args.swap_space and args.swap_space_blocks:
        raise FieldValueError("swap_space", "give the swap space once: swap_space (GiB) or "
                              "swap_space_blocks, not both")
    check_int("max_num_seqs", args.max_num_seqs, low=1)
    check_int("max_logprobs", args.max_logprobs, low=0, allowed=(-1,))  # -1: no cap
    for name in ("num_gpu_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            check_int(name, getattr(args, name), low=1)
    if args.preemption_mode == "swap" and args.kv_layout != "paged":
        raise FieldValueError("preemption_mode", "preemption_mode 'swap' moves blocks: it needs "
                              "kv_layout='paged'")
    if args.batching == "static" and args.kv_layout != "contiguous":
        raise FieldValueError("batching", "batching='static' is the traditional baseline: it "
                              "reserves each request's memory up front and never preempts, so "
                              "it needs kv_layout='contiguous'")
    if args.enable_prefix_caching and args.kv_layout != "paged":
        raise FieldValueError("enable_prefix_caching", "enable_prefix_caching shares blocks: it "
                              "needs kv_layout='paged'")

    # -- what the checkpoint decides ---------------------------------------------------------
    dtype_name = resolve_dtype(dtype_name, device, args.model)
    # A name or a GGUF -> a folder (converted in dtype_name; a folder's own dtype is kept).
    model_dir = resolve_model(args.model, None if dtype_name == "auto" else dtype_name)
    cfg = load_config(model_dir)  # says what is wrong with a missing, empty or bad folder
    quantization = _saved_quantization(args, cfg)
    if cfg.quantization and args.quantization is None and _dtype_name(args.dtype) == "auto":
        dtype_name = auto_quantized_dtype(device)  # a quantized checkpoint's activations
    if cfg.is_mla and args.tensor_parallel_size > 1:
        raise FieldValueError("tensor_parallel_size", f"{args.model} uses multi-head latent "
                              "attention, whose one latent row a token is shared by every "
                              "head: splitting it across ranks is not built; use "
                              "tensor_parallel_size=1")
    model_dir = Path(model_dir)
    if dtype_name == "auto":
        dtype_name = auto_dtype(device, cfg.dtype)
    kv_format = _sixteen_bit_cache(kv_format, dtype_name)
    if cfg.is_mla and kv_format.name != "auto":
        raise FieldValueError("kv_cache_dtype", f"kv_cache_dtype {kv_format.name!r}: the "
                              f"latent cache of {args.model} (multi-head latent attention) is "
                              "stored in the model's dtype; a quantized latent is not built: "
                              "use kv_cache_dtype='auto'")
    if args.quantization == "gguf" and converted_from(model_dir) is None:
        raise FieldValueError("quantization", f"quantization 'gguf' serves a GGUF file's own "
                              f"blocks; {args.model} is not a .gguf model: give a .gguf file "
                              "or a name such as smollm2-135m-instruct, or use 'int8' / 'int4'")
    _check_skip_names(quant_skip, cfg)
    spec = _check_draft(spec, cfg, dtype_name)
    if kv_format.values_per_byte == 2 and cfg.head_dim % 2:
        raise FieldValueError("kv_cache_dtype", f"kv_cache_dtype 'int4' packs two values per "
                              f"byte, half of head_dim into each nibble; this model's head_dim "
                              f"{cfg.head_dim} is odd: use 'int8' or 'fp8'")
    max_model_len = cfg.max_position_embeddings if args.max_model_len is None \
        else args.max_model_len
    if max_model_len > cfg.max_position_embeddings:
        raise FieldValueError("max_model_len", f"max_model_len {max_model_len} exceeds the "
                              f"model's {cfg.max_position_embeddings} positions")
    max_tokens = args.max_num_batched_tokens
    if max_tokens is None:  # vLLM's default: a whole prompt fits one step
        max_tokens = 2048 if args.enable_chunked_prefill else max(2048, max_model_len)
    if not args.enable_chunked_prefill and max_tokens < max_model_len:
        raise FieldValueError("max_num_batched_tokens", f"max_num_batched_tokens ({max_tokens}) "
                              f"must be >= max_model_len ({max_model_len}) unless "
                              "enable_chunked_prefill: a whole prompt must fit in one step")
    size = kv_size(model_dir, dtype_name, kv_format.name)  # scales included
    # A block id's bytes: its row in every tensor its KV cache group's layers share (a slab
    # layout keeps every layer's rows in one group)
    per_block = size.bytes_per_block(args.block_size) if args.kv_layout == "paged" \
        else size.bytes_per_token * args.block_size
    if args.tensor_parallel_size > 1:
        try:
            check_tensor_parallel_size(cfg, args.tensor_parallel_size)
        except ValueError as err:
            raise FieldValueError("tensor_parallel_size", str(err)) from None
        # Each rank's pool holds its KV heads only: kv_cache_memory is per rank (per GPU), sized
        # for the rank holding the most heads.
        most = max(len(attention_heads(cfg, r, args.tensor_parallel_size)[1])
                   for r in range(args.tensor_parallel_size))
        per_block = per_block * most // cfg.num_kv_heads
    num_gpu_blocks = _num_gpu_blocks(args, runner, device, per_block)
    swap_space_blocks = args.swap_space_blocks or int(args.swap_space * 2**30) // per_block
    if (num_gpu_blocks is not None and args.kv_layout == "contiguous"
            and args.reservation_policy == "max"
            and num_gpu_blocks * args.block_size < max_model_len):
        raise FieldValueError("max_model_len", f"kv_layout='contiguous' with the 'max' policy "
                              f"reserves max_model_len = {max_model_len} slots per request, more "
                              f"than the whole pool of {num_gpu_blocks * args.block_size}: give "
                              "the pool more memory, lower max_model_len, or use "
                              "reservation_policy 'pow2' or 'oracle'")
    return EngineConfig(
        model_dir=model_dir, model_config=cfg, dtype=FLOAT_DTYPES[dtype_name], device=device,
        block_size=args.block_size, num_gpu_blocks=num_gpu_blocks,
        swap_space_blocks=swap_space_blocks, kv_layout=args.kv_layout,
        reservation_policy=args.reservation_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduler_config=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max_tokens,
            max_model_len=max_model_len, preemption_mode=args.preemption_mode,
            enable_chunked_prefill=args.enable_chunked_prefill, batching=args.batching),
        seed=args.seed, backend=args.backend, model_runner=runner,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=(DEFAULT_GPU_MEMORY_UTILIZATION
                                if args.gpu_memory_utilization is None
                                else args.gpu_memory_utilization),
        kv_cache_dtype=kv_format.name, calculate_kv_scales=args.calculate_kv_scales,
        quantization=quantization, quantization_group_size=args.quantization_group_size,
        quantization_skip=quant_skip, tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs, speculative_config=spec)
# --8<-- [end:create_engine_config]


def _check_speculation(args: EngineArgs) -> SpeculativeConfig | None:
    """speculative_config's keys, and the options it cannot run with (refused by name)."""
    spec = check_speculative_config(args.speculative_config)
    if spec is None:
        return None
    if args.batching == "static":
        raise FieldValueError("speculative_config", "speculative_config needs continuous "
                              "batching: a static batch pads every member to the same step, "
                              "so a verification run of k + 1 tokens has no place in it")
    if args.kv_layout != "paged":
        raise FieldValueError("speculative_config", "speculative_config books slots for "
                              "proposals and gives the rejected ones back: it needs "
                              "kv_layout='paged' (a contiguous slab is reserved whole)")
    if spec.method == "draft_model" and args.tensor_parallel_size > 1:
        raise FieldValueError("speculative_config", "a draft model runs on one rank; use "
                              "method 'ngram' with tensor_parallel_size > 1")
    return spec


def _check_draft(spec: SpeculativeConfig | None, cfg: ModelConfig,
                 dtype_name: str) -> SpeculativeConfig | None:
    """A draft model's folder resolved and its config read (no weights): its vocabulary
    must be the target's, token for token the same ids."""
    if spec is None or spec.method != "draft_model":
        return spec
    field = "speculative_config.model"
    try:
        draft_dir = Path(resolve_model(spec.model, None if dtype_name == "auto" else dtype_name))
        draft = load_config(draft_dir)
    except (OSError, ValueError) as err:
        raise FieldValueError(field, f"{field} {spec.model!r}: {err}") from None
    if draft.vocab_size != cfg.vocab_size:
        raise FieldValueError(field, f"{field} {spec.model!r} has a vocabulary of "
                              f"{draft.vocab_size} tokens, the target's has {cfg.vocab_size}: "
                              "a draft must share the target's vocabulary (its token ids "
                              "are proposed as the target's)")
    windows = [w for w in draft.sliding_windows if w is not None]
    if windows and spec.num_speculative_tokens >= min(windows):
        # its proposals would push the window past tokens it must roll back to
        raise FieldValueError("speculative_config.num_speculative_tokens",
                              f"num_speculative_tokens {spec.num_speculative_tokens}: the "
                              f"draft {spec.model!r} slides over a window of {min(windows)} "
                              "tokens, and its blocks behind the window go back to the pool "
                              f"while it proposes; use fewer than {min(windows)}")
    return replace(spec, draft_model_dir=draft_dir)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):  # vLLM takes torch.float16 as well as "float16"
        dtype = str(dtype).removeprefix("torch.")
    if dtype != "auto" and dtype not in FLOAT_DTYPES:
        raise FieldValueError("dtype", f"dtype {dtype!r} is not supported; choose one of "
                              f"{('auto', *FLOAT_DTYPES)}")
    return dtype


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX; read from Linux's
    /proc/cpuinfo). Elsewhere (AVX2 only, most laptops; another OS) bf16 is emulated: each
    value widened to float32 in software, slower than float32 itself. PAGEDLLM_CPU_ISA=avx2
    (or scalar) runs this machine as a CPU without it (kernels/cpu_ops.py)."""
    if os.environ.get("PAGEDLLM_CPU_ISA") in ("avx2", "scalar"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def auto_quantized_dtype(device: torch.device) -> str:
    """What dtype='auto' computes a quantized model's activations in: bf16 (seed 003's
    pairing, what the weight-only kernels of a GPU take) on a GPU or a CPU with native bf16;
    float32 on any other CPU, where emulated bf16 would make every product slower than the
    float32 model's (lesson 18's table per CPU)."""
    return "bfloat16" if device.type == "cuda" or native_bf16() else "float32"


# --8<-- [start:auto_dtype]
def auto_dtype(device: torch.device, checkpoint_dtype: torch.dtype) -> str:
    """What dtype='auto' computes in, as vLLM means it: the checkpoint's own dtype on a GPU
    (bf16 for SmolLM2 and the Llama family: float32 would move twice the bytes per weight and
    miss the tensor cores), float32 on the CPU, where the engine is tested and where bf16
    matrix products are emulated on many processors."""
    name = str(checkpoint_dtype).removeprefix("torch.")
    if device.type == "cuda" and name in FLOAT_DTYPES:
        return name
    return "float32"
# --8<-- [end:auto_dtype]


def resolve_dtype(dtype_name: str, device: torch.device, model) -> str:
    """'auto' before the checkpoint is read: float32 on the CPU; a GGUF (which holds no single
    dtype to take) is converted in bfloat16 on a GPU. Otherwise 'auto' stays, for the folder's
    config to decide."""
    if dtype_name != "auto":
        return dtype_name
    if device.type != "cuda":
        return "float32"
    gguf = isinstance(model, str) and model.strip().lower() in MODELS
    if gguf or (isinstance(model, str | Path) and str(model) and find_gguf(model) is not None):
        return "bfloat16"
    return "auto"


def _check_backend(backend) -> None:
    """A Backend bundle of ops (swap one with dataclasses.replace), or None (the tier's own
    for the device); not a function."""
    if backend is not None and not isinstance(backend, Backend):
        raise FieldTypeError("backend", f"backend must be a pagedllm.reference.ops.Backend (e.g. "
                             f"REFERENCE_BACKEND, or dataclasses.replace(REFERENCE_BACKEND, "
                             f"op=...)) or None (the tier's own), got {backend!r} "
                             f"({type(backend).__name__})")


def _check_tier_options(args: EngineArgs, runner: type[ModelRunner]) -> None:
    """What a tier's model runner does not do is refused, naming the tier that does it."""
    if not runner.runs_baselines:
        if args.kv_layout == "contiguous":
            raise FieldValueError("kv_layout", f"kv_layout {args.kv_layout!r}: the {runner.tier} "
                                  "tier runs the paged layout only; the contiguous baseline is "
                                  "the reference tier's (pagedllm.reference.LLM)")
        if args.batching == "static":
            raise FieldValueError("batching", f"batching {args.batching!r}: the {runner.tier} "
                                  "tier runs continuous batching only; the static baseline is "
                                  "the reference tier's (pagedllm.reference.LLM)")
    if args.gpu_memory_utilization is not None:
        if not runner.profiles_kv_cache:
            raise FieldValueError("gpu_memory_utilization", f"gpu_memory_utilization sizes the "
                                  "KV pool by a profiling step, which the optimized tier does "
                                  f"(pagedllm.optimized.LLM); the {runner.tier} tier takes "
                                  "num_gpu_blocks or kv_cache_memory")
        # Checked on every device, though only CUDA uses it: a typo must not pass on a laptop
        # and fail on the server.
        check_float("gpu_memory_utilization", args.gpu_memory_utilization, low=0.0, high=1.0,
                    low_open=True)
    if args.enforce_eager and not runner.captures_graphs:
        raise FieldValueError("enforce_eager", f"enforce_eager turns CUDA graphs (and the CPU's "
                              f"one-call decode step) off, which the {runner.tier} tier never "
                              "uses; it is an option of the optimized tier "
                              "(pagedllm.optimized.LLM)")


def _check_tensor_parallel(args: EngineArgs, device: torch.device) -> None:
    """The sizes that can be refused before the checkpoint is read (the heads are checked
    once it is), and the options a tensor-parallel engine does not run yet."""
    check_int("tensor_parallel_size", args.tensor_parallel_size, low=1)
    tp = args.tensor_parallel_size
    if tp == 1:
        return
    if device.type == "cuda" and tp > torch.cuda.device_count():
        raise FieldValueError("tensor_parallel_size", f"tensor_parallel_size {tp} needs {tp} "
                              f"GPUs, one per rank; {torch.cuda.device_count()} are visible")
    if args.quantization == "gguf":
        raise FieldValueError("quantization", "quantization 'gguf' keeps the file's 4-bit "
                              "blocks whole, and tensor parallelism splits them: use 'int8' or "
                              "'int4' (quantized after the split), or tensor_parallel_size=1")
    if args.num_gpu_blocks is None and args.kv_cache_memory is None and \
            args.model_runner.profiles_kv_cache and device.type == "cuda":
        raise FieldValueError("tensor_parallel_size", "a tensor-parallel engine does not "
                              "profile each rank's GPU yet: give kv_cache_memory (bytes per "
                              "rank) or num_gpu_blocks")


def _check_pipeline_parallel(args: EngineArgs) -> None:
    """pipeline_parallel_size: vLLM's flag, taken at 1 (one stage: every layer on every rank);
    more is refused, naming the flag and the parallelism this engine runs instead."""
    check_int("pipeline_parallel_size", args.pipeline_parallel_size, low=1)
    if args.pipeline_parallel_size > 1:
        raise FieldValueError("pipeline_parallel_size", f"pipeline_parallel_size "
                              f"{args.pipeline_parallel_size}: this engine splits a model "
                              "across GPUs by tensor parallelism only (every layer on every "
                              "rank, one all-reduce after o_proj and down_proj), which keeps "
                              "all GPUs busy on every token of one node, as seed 003 argues; "
                              "pipeline stages would idle between micro-batches. Use "
                              "tensor_parallel_size instead (pipeline_parallel_size 1)")


def _sixteen_bit_cache(fmt: KVCacheFormat, dtype_name: str) -> KVCacheFormat:
    """A 16-bit kv_cache_dtype (float16, bfloat16, fp16, bf16) naming the model's own dtype is
    "auto": the cache the model has anyway. Another dtype stays: a cache rounded to it."""
    if fmt.scales == "none" and fmt.storage_dtype == FLOAT_DTYPES.get(dtype_name):
        return kv_cache_format("auto")
    return fmt


def _check_quantization(args: EngineArgs) -> tuple[str, ...]:
    """quantization, its group size and the layers it skips; the skip list as a tuple (None:
    no skip). The group size is an int >= 1 whatever the scheme (a typo must not wait for the
    scheme that reads it: 32.0 would pass ``in (32, ...)`` and fail inside torch at load), one
    of INT4_GROUP_SIZES for int4. Skip entries are names of layers or runs of their parts,
    so none is empty or has an empty part; whether each names a layer of this model is checked
    once the checkpoint's config is read (``_check_skip_names``)."""
    if args.quantization is not None and not isinstance(args.quantization, str):
        raise FieldTypeError("quantization", f"quantization must be None or a name, one of "
                             f"{WEIGHT_QUANTIZATIONS}; got {args.quantization!r}")
    check_choice("quantization", args.quantization, (None, *WEIGHT_QUANTIZATIONS))
    check_int("quantization_group_size", args.quantization_group_size, low=1)
    if args.quantization == "int4":
        check_choice("quantization_group_size", args.quantization_group_size, INT4_GROUP_SIZES)
    skip = check_names("quantization_skip", args.quantization_skip, "['lm_head']")
    bad = [name for name in skip if "" in name.strip().split(".")]
    if bad:
        raise FieldValueError("quantization_skip", f"quantization_skip {bad[0]!r} has an empty "
                              "part: an entry is a layer's module name or a run of its "
                              "dot-separated parts, e.g. 'down_proj' or 'mlp.down_proj'")
    return skip


def _saved_quantization(args: EngineArgs, cfg: ModelConfig) -> str | None:
    """The scheme the engine runs: quantization=, or the one a quantized checkpoint (a
    `pagedllm quantize` folder) saves its layers in. Naming another scheme for such a folder
    is refused: its layers hold codes, not the float weights another scheme would round."""
    if cfg.quantization is None:
        return args.quantization
    if args.quantization not in (None, cfg.quantization):
        raise FieldValueError("quantization", f"quantization {args.quantization!r}: "
                              f"{args.model} is saved quantized ({cfg.quantization!r}, by "
                              "`pagedllm quantize`), and another scheme would round its codes "
                              f"again: leave quantization unset (or {cfg.quantization!r}), or "
                              "quantize the float checkpoint it came from")
    if args.tensor_parallel_size > 1:
        raise FieldValueError("tensor_parallel_size", f"tensor_parallel_size "
                              f"{args.tensor_parallel_size}: {args.model} is saved quantized, "
                              "and splitting its saved codes across ranks is not built: use "
                              "tensor_parallel_size=1, or quantize the float checkpoint at "
                              f"load (quantization={cfg.quantization!r}), which does split")
    return cfg.quantization


def _check_skip_names(skip: tuple[str, ...], cfg: ModelConfig) -> None:
    """Every skip entry names a linear layer of the model (``check_skip``), checked on the
    model's module tree built on the meta device (no memory, no weights): before any weight
    loads, on every tier, and whatever the scheme (a typo refused without quantization too)."""
    if not skip:
        return
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.model_type](cfg)
    try:
        check_skip(skip, model)
    except ValueError as err:
        raise FieldValueError("quantization_skip", str(err)) from None


def _kv_cache_format(args: EngineArgs) -> KVCacheFormat:
    """kv_cache_dtype and calculate_kv_scales: a known name, one this torch can store, and
    scales to calculate only where they are per tensor."""
    if not isinstance(args.kv_cache_dtype, str):
        raise FieldTypeError("kv_cache_dtype", f"kv_cache_dtype must be a name, one of "
                             f"{', '.join(KV_CACHE_DTYPES)}; got {args.kv_cache_dtype!r}")
    try:
        fmt = kv_cache_format(args.kv_cache_dtype)
    except ValueError as err:
        raise FieldValueError("kv_cache_dtype", str(err)) from None
    if fmt.scales == "per_tensor" and fmt.storage_dtype is None:
        raise FieldValueError("kv_cache_dtype", f"kv_cache_dtype {args.kv_cache_dtype!r} needs "
                              f"torch's float8 dtypes, which torch {torch.__version__} lacks: "
                              "use 'int8' (the same bytes) or a torch >= 2.1")
    if args.calculate_kv_scales and fmt.scales != "per_tensor":
        raise FieldValueError("calculate_kv_scales", f"calculate_kv_scales sets fp8's per-tensor "
                              f"scales from the first batch; kv_cache_dtype "
                              f"{args.kv_cache_dtype!r} "
                              + ("has no scales" if fmt.scales == "none" else
                                 "computes a scale for every token as it is written") +
                              ": leave calculate_kv_scales off, or use kv_cache_dtype 'fp8'")
    return fmt


def _num_gpu_blocks(args: EngineArgs, runner: type[ModelRunner], device: torch.device,
                    per_block: int) -> int | None:
    """Blocks in the KV pool: as given; or as many as kv_cache_memory buys (per_block bytes a
    block, scales included); or None, for a runner that profiles a step on CUDA to find what the
    GPU has left (vLLM's way)."""
    if args.num_gpu_blocks is not None:
        return args.num_gpu_blocks
    if args.kv_cache_memory is None and runner.profiles_kv_cache and device.type == "cuda":
        return None
    memory = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    num_gpu_blocks = memory // per_block
    if num_gpu_blocks < 1:
        raise FieldValueError("kv_cache_memory", f"kv_cache_memory = {args.kv_cache_memory} "
                              f"bytes holds no block of {args.block_size} tokens "
                              f"({per_block} bytes)")
    return num_gpu_blocks
