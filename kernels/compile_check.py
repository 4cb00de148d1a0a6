"""Compile every launch the engine makes for real GPUs, without a GPU, and report what each costs.

Why this exists
---------------
CI runs the kernels under Triton's interpreter: numpy, one program at a time, on the CPU. The
interpreter checks what a kernel *computes*, but it never sees the GPU compiler. Some kernels
it runs happily are rejected by the compiler (a ``tl.dot`` whose inner dimension is below 16,
a call to a plain Python function), and some compile but ask for more shared memory than a
multiprocessor has, which fails only when the kernel is loaded on the device. Both would first
show on a GPU machine. Triton's compiler itself, though, runs on any machine: source to
Triton IR, to LLVM IR, to PTX, and through the ``ptxas`` that ships with Triton to a cubin, for
any target. This module does that for every launch the engine makes, and reads the result.

Phase 1: record
---------------
Every launcher goes through ``kernel_runner`` (``runtime.py``), and ``runtime.launch_hook`` lets us
see each launch before it runs. The record phase runs the engine (the optimized tier,
``pagedllm.optimized.LLM``) under the interpreter over a matrix meant to reach every kernel path:
every model family in fp32, bf16 and fp16, prompts and decodes batched together, chunked prefill,
prefix-cache hits, copy-on-write (n > 1 and beam search), a sliding window, every sampling option
(greedy, top-k, top-p, min_p, seeds, logprobs, tokens blocked by min_tokens; the penalties and
logit_bias through their own kernel), speculative decoding (n-gram runs verified by their
kernel), a head size that is not a power of two, and every
quantized ``kv_cache_dtype`` (fp8 e4m3 and e5m2, int8, int4: store_kv's quantizing and
attention's dequantizing paths). The lessons' Triton exercises (lessons/exercises: the kernels a
learner writes for lessons 10 and 13) are compiled too, their solutions at the shapes of their
tests and of real models: a learner's kernel is otherwise only ever interpreted. They are not
part of the package: they are loaded from the repository by path, where it has them. Then it
calls the launchers directly at shapes of
real models that the tiny checkpoints do not have: heads 64 to 256 wide, flash-decoding's split
forced on (``num_splits=``) and chosen by the launcher for a 530-token context, wide rows and
vocabularies (with a structured output's token bitmask: its kernel runs before the sampler's),
speculative verification at every tile width up to 64 proposals.
Those calls matter twice: interpreting a 530-token prefill through the engine would
take minutes, and on a GPU the engine hands paged attention device-side lengths, so its launcher
picks tiles and splits from bounds rather than from the exact maxima it sees here.
Quantized caches get one engine run per format (chunked prefill, so prefills, chunks and
decodes) and direct calls at real shapes for flash-decoding's split path: one configuration
each in the ``ci`` matrix, not the product of formats and everything else.

fp8 reaches the compiler as bytes: the launchers pass fp8 caches as uint8 and the kernels
convert by integer arithmetic, so no launch has an fp8 pointer type, and an sm_80 target (whose
Triton has no ``fp8e4nv`` type at all: ``type fp8e4nv not supported in this architecture``)
compiles the e4m3 launches like any other.

A launch is recorded as the compiler will see it: Triton's own binder (the code
``JITFunction.run`` calls) turns the arguments into a signature (``*bf16`` for a bf16 tensor,
``i32`` or ``i64`` for an int), the attributes it specialises on (a pointer or an int divisible
by 16), the ints equal to 1 that become constants, and the ``tl.constexpr`` values; the launch
options add ``num_warps`` and ``num_stages``. Two launches that agree on all of that are one
compiled kernel, so the record keeps each distinct one once.

Two launchers pass the interpreter something else than a GPU: paged attention upcasts bf16
for the interpreter's ``tl.dot`` (``DOT_F32``), and the sampler uses numpy's exp and log
instead of libdevice's (``LIBDEVICE``) and leaves ``num_warps`` to the interpreter.
``GPU_VIEW`` below rewrites those recorded launches into the ones a GPU gets.

Phase 2: compile, in a fresh process
------------------------------------
The interpreter patches ``triton.language`` while it runs, and the compiler fails on the
patched module (``'value' object has no attribute 'dtype'``), so the compile phase runs in a
process that never interpreted anything. For each recorded launch and target it calls

    triton.compile(ASTSource(fn, signature, constexprs, attrs),
                   target=GPUTarget("cuda", capability, 32),
                   options=dict(num_warps=..., num_stages=...))

for sm_80 (A100), sm_90 (H100, H200) and sm_100 (B200, which Triton 3.9 targets). A failure is
reported with the kernel, its constexprs and the compiler's message.

The resource report
-------------------
A compiled kernel's metadata says how much shared memory one program needs (``shared``). It
must fit what one program may have on the target: Triton refuses to load a kernel above it
(the per-block opt-in maximum: 163 KiB on an A100 out of its 164 KiB per multiprocessor, 227
of 228 KiB on Hopper and Blackwell). Registers and spills come from ``ptxas -v``: the log of
the run that builds the cubin (``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90 on, both
shipped with Triton), or the same command again for a kernel found in Triton's cache. From
these an occupancy estimate: how many programs fit on one multiprocessor at once, limited by
its 65536 registers (allocated per warp, 256 at a time), its shared memory (plus the 1 KiB the
driver reserves per program), its 64 warps (2048 threads) and 32 resident programs. More
resident programs hide more memory latency.

    python -m pagedllm.kernels.compile_check                     # both phases, print the table
    python -m pagedllm.kernels.compile_check --kernel _paged_attention_kernel   # each launch
    python -m pagedllm.kernels.compile_check --json report.json  # and write everything
    python -m pagedllm.kernels.compile_check --matrix ci --targets 80,90   # what CI runs

On two cores the full matrix took 12 minutes before quantized caches (2.5 interpreting, the rest
compiling 339 kernels for three targets; fp32 attention, unrolled into plain multiply-adds,
compiles slowest), which add about 110 launches to it; the ``ci`` matrix (94 launches, 21 of
them quantized) for two targets 3 to 5 minutes, under 3 once Triton's cache holds the kernels.
"""

import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "pagedllm.kernels"
# One module per kernel; the rest of the package launches nothing.
KERNEL_MODULES = tuple(sorted(
    path.stem for path in Path(__file__).parent.glob("*.py")
    if path.stem not in ("__init__", "backend", "runtime", "compile_check")))


@dataclass(frozen=True)
class Target:
    arch: str
    gpus: str
    smem_per_sm: int  # bytes of shared memory on one multiprocessor
    smem_per_program: int  # the most one program (thread block) may have: cudaFuncSetAttribute
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64  # 2048 threads
    max_programs_per_sm: int = 32
    reserved_smem: int = 1024  # the driver's share of shared memory per resident program


TARGETS = {
    80: Target("sm_80", "A100", 164 * 1024, 163 * 1024),
    90: Target("sm_90a", "H100/H200", 228 * 1024, 227 * 1024),
    100: Target("sm_100a", "B200", 228 * 1024, 227 * 1024),
}


# -- which functions are kernels ----------------------------------------------------------------
def jit_functions() -> dict[str, object]:
    """Every ``@triton.jit`` function of the package's kernel modules, by name."""
    import importlib

    from triton.runtime.jit import JITFunction
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        found.update({name: value for name, value in vars(module).items()
                      if isinstance(value, JITFunction) and value.__module__ == module.__name__})
    return found


# The lessons' Triton exercises, by their solutions' file names: loaded by path, under module
# names of their own (the compile phase finds a recorded kernel again by that name).
EXERCISES = Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "solutions"
EXERCISE_MODULE = "lessons.exercises.solutions"
EXERCISE_FILES = ("triton_paged_attention_exercise", "triton_store_kv_exercise")


def exercise_module(stem: str):
    """One exercise's solution module, imported from its file (once per process)."""
    import importlib.util
    name = f"{EXERCISE_MODULE}.{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXERCISES / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def exercise_kernels() -> dict[str, object]:
    """The kernels of the lessons' Triton exercises (their solutions), by name; none where the
    repository's lessons/ is absent (an installed wheel)."""
    if not EXERCISES.is_dir():
        return {}
    kernels = {}
    for stem in EXERCISE_FILES:
        module = exercise_module(stem)
        for name in re.findall(r"kernel_runner\(\s*(\w+)", (EXERCISES / f"{stem}.py").read_text()):
            kernels[name] = getattr(module, name)
    return kernels


def launched_kernels() -> dict[str, object]:
    """Every kernel of the package, by name: the ``@triton.jit`` functions a launcher hands to
    ``kernel_runner``. The others (``_mix64``, ``_exp``, ...) are helpers that kernels call;
    they are compiled inside the kernels that call them."""
    import importlib
    kernels = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"{PACKAGE}.{module_name}")
        source = Path(module.__file__).read_text()
        for name in re.findall(r"kernel_runner\(\s*(\w+)", source):
            kernels[name] = getattr(module, name)
    return kernels


# -- phase 1: record ----------------------------------------------------------------------------
def _gpu_paged_attention(constexprs, options):
    return {**constexprs, "DOT_F32": False}, options  # a GPU's tl.dot takes bf16 as it is


def _gpu_sample(constexprs, options):
    # sampling.py: libdevice's exp/log, and num_warps=8 from a tile of 1024 tokens on.
    return ({**constexprs, "LIBDEVICE": True},
            {**options, "num_warps": 8 if constexprs["BLOCK"] >= 1024 else 4})


def _gpu_penalties(constexprs, options):
    # penalties.py: no fused multiply-add, so that x - f * count rounds as torch's does.
    return constexprs, {**options, "enable_fp_fusion": False}


# What a launcher passes a GPU instead of what it passed the interpreter, by kernel.
GPU_VIEW = {"_paged_attention_kernel": _gpu_paged_attention, "_sample_kernel": _gpu_sample,
            "_quant_linear_kernel": _gpu_paged_attention,  # the same DOT_F32 switch
            "_mla_decode_kernel": _gpu_paged_attention,
            "_penalties_kernel": _gpu_penalties}


class Recorder:
    """A ``launch_hook``: keeps each distinct launch once, as the compiler will see it."""

    def __init__(self):
        self.launches: dict[str, dict] = {}
        self.case = "?"
        self._binders = {}

    def _binder(self, kernel):
        """Triton's argument binder for this kernel, as ``JITFunction`` builds it for a CUDA
        device (the same code decides signature and specialisation at a real launch)."""
        fn = getattr(kernel, "fn", kernel)  # an InterpretedFunction wraps the Python function
        if fn not in self._binders:
            from triton.backends.compiler import GPUTarget
            from triton.compiler.compiler import make_backend
            from triton.runtime.jit import JITFunction, create_function_from_signature
            kwargs = getattr(kernel, "kwargs", None) or {}  # do_not_specialize, if any
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(fn, **{
                k: v for k, v in kwargs.items() if k.startswith("do_not_specialize")})
            backend = make_backend(GPUTarget("cuda", 90, 32))
            self._binders[fn] = (jit, backend,
                                 create_function_from_signature(jit.signature, jit.params,
                                                                backend))
        return self._binders[fn]

    def __call__(self, kernel, grid, args, kwargs):
        launch = describe_launch(*self._binder(kernel), args, kwargs)
        key = json.dumps([launch[k] for k in ("kernel", "signature", "constexprs", "attrs",
                                              "options")], sort_keys=True)
        if key in self.launches:
            self.launches[key]["count"] += 1
        else:
            self.launches[key] = {**launch, "case": self.case, "count": 1}


def describe_launch(jit, backend, binder, args, kwargs) -> dict:
    """One launch, as the compiler sees it: signature, specialisation attributes, constexprs and
    the options the launcher chose, all by argument name (JSON-ready)."""
    names = jit.arg_names
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = jit._pack_args(backend, dict(kwargs), bound,
                                                     specialization, options)
    constexprs = {names[path[0]]: value for path, value in constexprs.items()}
    attrs = {names[path[0]]: value for path, value in attrs.items() if value}
    chosen = {k: kwargs[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
              if k in kwargs}
    fix = GPU_VIEW.get(jit.__name__)
    if fix is not None:
        constexprs, chosen = fix(constexprs, chosen)
    return {"kernel": f"{jit.fn.__module__}:{jit.__name__}", "signature": signature,
            "constexprs": constexprs, "attrs": attrs, "options": chosen}


@dataclass
class Case:
    name: str
    checkpoint: str | None  # which tiny checkpoint it loads (None: direct launcher calls)
    run: object  # run(checkpoint_path or None)
    weight: float = 1.0  # rough seconds, to balance the record processes


FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "opt")
DTYPES = ("float32", "bfloat16", "float16")
CHECKPOINTS = {  # name -> (family, tiny_config overrides)
    **{family: (family, {}) for family in FAMILIES},
    "llama-head24": ("llama", {"head_dim": 24}),  # not a power of two: 24 pads to 32
}


def _llm(path, dtype, **options):
    from pagedllm.optimized import LLM
    return LLM(str(path), dtype=dtype, **{"block_size": 8, "num_gpu_blocks": 64, **options})


def _mixed_batch(path, dtype):
    """A 9-token and a 3-token prompt batched (the first spans two blocks): a greedy one, and
    n=2 seeded sampling with top-k, top-p, logprobs and min_tokens (EOS and the stop ids
    blocked) whose two samples share the prompt's last block until the decode copies it."""
    from pagedllm.optimized import SamplingParams as P
    _llm(path, dtype).generate(
        [{"prompt_token_ids": list(range(3, 12))}, {"prompt_token_ids": [5, 6, 7]}],
        [P(temperature=0, max_tokens=2, ignore_eos=True),
         P(n=2, temperature=0.8, top_k=5, top_p=0.9, seed=1, logprobs=2, min_tokens=2,
           stop_token_ids=[7, 9], max_tokens=2)], use_tqdm=False)


def _chunks_and_prefix_hits(path, dtype, kv_cache_dtype="auto"):
    """Chunked prefill (8-token chunks) with prefix caching: the second round hits the cache
    and computes only the prompts' uncached tails."""
    from pagedllm.optimized import SamplingParams as P
    llm = _llm(path, dtype, enable_chunked_prefill=True, max_num_batched_tokens=8,
               enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    shared = list(range(3, 13))  # a full block of 8 shared, then each prompt's own tail
    prompts = [{"prompt_token_ids": shared + [30, 31]}, {"prompt_token_ids": shared + [40]}]
    for _ in range(2):
        llm.generate(prompts, P(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)


def _beam_search(path, dtype):
    """Beams fork and copy their shared last block on write."""
    from pagedllm.optimized import BeamSearchParams
    _llm(path, dtype).beam_search([{"prompt_token_ids": [4, 5, 6, 7, 8, 9]}],
                                  BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))


def _direct(fn):
    """A case that calls launchers itself, with seeded random inputs."""
    def run(_):
        import torch
        torch.manual_seed(0)
        fn()
    return run


def _attention(dtype, head_dim, heads, kv_heads, seqs, window=None, kv_cache_dtype="auto",
               **kwargs):
    """paged_attention over random sequences [(q_len, seq_len)] in a paged cache of 16-token
    blocks (the launcher's keywords, ``num_splits`` and ``block_m``, passed through). A
    quantized kv_cache_dtype fills the cache through store_kv, whose launch is recorded too."""
    import torch

    from pagedllm.kernels.paged_attention import paged_attention
    from pagedllm.kernels.store_kv import store_kv
    from pagedllm.reference.ops import kv_cache_format
    block = 16
    tables = [-(-seq_len // block) for _, seq_len in seqs]
    num_blocks = sum(tables) + 1
    fmt = kv_cache_format(kv_cache_dtype)
    quant = ()
    if fmt.scales == "none":
        k = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
        v = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    else:  # random bytes and scales (quantizing the whole pool would interpret for minutes)
        shape = (num_blocks, block, kv_heads, fmt.storage_head_dim(head_dim))
        k, v = (torch.randint(0, 120, shape, dtype=torch.uint8).view(fmt.storage_dtype)
                for _ in range(2))  # below 120: no fp8 NaN or inf
        if fmt.scales == "per_tensor":
            scales = torch.tensor([0.02]), torch.tensor([0.03])
        else:
            pair = (2,) if fmt.zero_point else ()  # int4: (scale, zero) pairs
            scales = tuple((torch.rand(*shape[:3], *pair) / 50).to(torch.bfloat16)
                           for _ in range(2))
        rows = torch.randn(2, 3, kv_heads, head_dim).to(dtype)  # store_kv's launch at this shape
        store_kv(rows[0], rows[1], k, v, torch.tensor([0, -1, 17]), kv_cache_dtype, *scales)
        quant = (kv_cache_dtype, *scales)
    perm = torch.randperm(num_blocks).to(torch.int32)
    block_tables = torch.zeros(len(seqs), max(tables), dtype=torch.int32)
    used = 0
    for b, n in enumerate(tables):
        block_tables[b, :n] = perm[used:used + n]
        used += n
    starts = [0, *itertools.accumulate(q for q, _ in seqs)]
    q = torch.randn(starts[-1], heads, head_dim).to(dtype)
    paged_attention(q, k, v, block_tables, torch.tensor([s for _, s in seqs], dtype=torch.int32),
                    torch.tensor(starts, dtype=torch.int32), head_dim ** -0.5, window, *quant,
                    **kwargs)


def _real_attention_shapes(full: bool):
    """Real models' heads (Llama 3 8B's 128 wide, grouped 4 to 1, fewer of them): the prefill
    tiles (128 rows, 8 warps; 64 in fp32), the decode tiles (one query's group of heads: 16
    rows), forced flash-decoding splits, both extreme head sizes. The largest shared memory of
    each dtype is here: bf16 and fp32 prefills of 256-wide heads."""
    import torch
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    prefill, decodes = [(40, 40)], [(1, 70), (1, 33)]
    _attention(bf16, 128, 8, 2, prefill)  # 160 rows of queries: 128-row programs
    _attention(bf16, 256, 4, 2, prefill)  # 256 wide: tiles of 32 keys
    _attention(fp32, 256, 4, 2, prefill)
    _attention(fp16, 80, 4, 2, decodes)  # not a power of two (Phi): padded to 128
    _attention(bf16, 128, 8, 2, decodes, num_splits=3)  # flash-decoding: 3 splits pad to 4
    _attention(fp16, 64, 4, 4, decodes, num_splits=16)  # MHA (group 1), the most splits
    _attention(bf16, 128, 8, 2, prefill + decodes, window=24)  # a sliding window, mixed step
    if not full:
        return
    for dtype in (bf16, fp16, fp32):
        _attention(dtype, 128, 8, 2, decodes)
    _attention(fp16, 128, 8, 2, prefill)
    _attention(fp32, 128, 8, 2, prefill)
    _attention(bf16, 128, 8, 2, [(10, 30)])  # 40 rows: 64-row programs
    _attention(bf16, 128, 8, 2, decodes, num_splits=4)
    _attention(fp32, 128, 8, 2, decodes, num_splits=3)
    _attention(bf16, 128, 8, 1, decodes)  # MQA: all 8 heads share a K/V head
    _attention(bf16, 128, 8, 2, decodes, window=24, num_splits=2)
    # A context long enough for the launcher's own heuristic to split (530 // 256 = 2 splits):
    # what a decode batch of a long prompt gets, without interpreting the 530-token prefill.
    _attention(bf16, 128, 8, 2, [(1, 530)])
    _attention(fp16, 64, 4, 4, [(1, 600), (1, 530)], window=300)
    _attention(bf16, 80, 4, 2, prefill)
    _attention(fp32, 80, 4, 2, prefill)
    _attention(bf16, 256, 4, 2, decodes)


def _quantized_attention_shapes(full: bool):
    """Paged attention over quantized caches at real shapes (and store_kv filling them):
    flash-decoding's split path for every format, the 128-row prefill tiles, heads that are not
    a power of two (int4's halves of 40 pad to 64). full: the shapes that bound shared memory
    and the rest of the product of formats and model dtypes."""
    import torch
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    prefill, decodes = [(40, 40)], [(1, 70), (1, 33)]
    _attention(bf16, 128, 8, 2, decodes, kv_cache_dtype="fp8_e4m3", num_splits=3)
    _attention(fp16, 80, 4, 2, decodes, kv_cache_dtype="fp8_e5m2", num_splits=2)
    _attention(fp16, 64, 4, 4, decodes, kv_cache_dtype="int8", num_splits=2)  # MHA
    _attention(bf16, 128, 8, 2, decodes, kv_cache_dtype="int4", num_splits=3)
    _attention(bf16, 80, 8, 2, prefill + decodes, kv_cache_dtype="int4")
    if not full:
        return
    for kv in ("fp8_e4m3", "fp8_e5m2", "int8", "int4"):
        for dtype in (bf16, fp16, fp32):
            _attention(dtype, 128, 8, 2, prefill, kv_cache_dtype=kv)
            _attention(dtype, 128, 8, 2, decodes, kv_cache_dtype=kv)
        _attention(bf16, 256, 4, 2, prefill, kv_cache_dtype=kv)
        if kv in ("int8", "int4"):  # fp32's 256-wide prefill, a byte and half a byte a value
            _attention(fp32, 256, 4, 2, prefill, kv_cache_dtype=kv)  # (90 s a compile)
        _attention(bf16, 128, 8, 2, prefill + decodes, window=24, kv_cache_dtype=kv)
        _attention(fp16, 64, 4, 4, decodes, kv_cache_dtype=kv, num_splits=16)
        _attention(bf16, 80, 4, 2, decodes, kv_cache_dtype=kv, num_splits=2)


def _real_small_op_shapes():
    import torch

    from pagedllm.kernels.copy_blocks import copy_blocks
    from pagedllm.kernels.rms_norm import rms_norm
    from pagedllm.kernels.rotary import rotary
    from pagedllm.kernels.silu_and_mul import silu_and_mul
    from pagedllm.kernels.store_kv import store_kv
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 80), (torch.float32, 128)):
        # K and V sliced out of a fused QKV row (strided views), 8 K/V heads, 16-token blocks
        qkv = torch.randn(3, 16 * head_dim).to(dtype)
        q = qkv[:, :8 * head_dim].view(3, 8, head_dim)
        k = qkv[:, 8 * head_dim:12 * head_dim].view(3, 4, head_dim)
        v = qkv[:, 12 * head_dim:].view(3, 4, head_dim)
        cache = torch.zeros(4, 16, 4, head_dim, dtype=dtype)
        store_kv(k, v, cache, cache.clone(), torch.tensor([0, -1, 37]))
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
        rotary(q, k, torch.tensor([0, 5, 900]), inv_freq)
    for dtype, hidden in ((torch.bfloat16, 4096), (torch.float16, 3000), (torch.float32, 2048)):
        x = torch.randn(2, hidden).to(dtype)
        w = torch.ones(hidden, dtype=dtype)
        rms_norm(x, w, 1e-5)
        rms_norm(x, w, 1e-5, residual=x.clone())
    silu_and_mul(torch.randn(2, 2 * 14336).to(torch.bfloat16))  # Llama 3 8B's MLP width
    silu_and_mul(torch.randn(2, 2 * 11008).to(torch.float16))
    # copy-on-write over the layers of a real cache, and the one-launch-per-cache fallback
    for dtypes in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        ks = [torch.randn(4, 16, 8, 128).to(dtypes[0]) for _ in range(2)]
        vs = [torch.randn(4, 16, 8, 128).to(dtypes[1]) for _ in range(2)]
        copy_blocks(ks, vs, torch.tensor([[0, 2], [1, 3]]))
    # ... and over quantized pools, as the engine copies them: the values (fp8, int8, int4's
    # bytes), then the per-token-head scales
    from pagedllm.reference.ops import kv_cache_format
    for kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2", "int8", "int4"):
        fmt = kv_cache_format(kv_cache_dtype)
        shape = (4, 16, 8, fmt.storage_head_dim(128))
        values = [[torch.zeros(shape, dtype=torch.uint8).view(fmt.storage_dtype)
                   for _ in range(2)] for _ in range(2)]
        copy_blocks(*values, torch.tensor([[0, 2], [1, 3]]))
        if fmt.scales == "per_token_head":
            pair = (2,) if fmt.zero_point else ()  # int4: (scale, zero) pairs
            scales = [[torch.ones(*shape[:3], *pair, dtype=torch.bfloat16) for _ in range(2)]
                      for _ in range(2)]
            copy_blocks(*scales, torch.tensor([[0, 2], [1, 3]]))


def _quant_linear_shapes(full: bool):
    """The weight-only products: int8, fp8 (e4m3 bytes widened in registers: sm_80 has no
    e4m3 type) and int4 in each group size, a decode's few rows and a
    prefill's many, with and without a bias, in each activation dtype (full) or in bf16 with one
    launch of each other dtype (ci). The tile sizes do not depend on N and K, so small weights
    give the launches of real ones."""
    import torch

    from pagedllm.kernels.quant_linear import quant_linear
    from pagedllm.reference.ops.weight_quant import quantize_fp8, quantize_int4, quantize_int8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(64, 256) * 0.05).to(dtype)
        schemes = [quantize_int8(w), quantize_fp8(w),
                   *(quantize_int4(w, g) for g in (32, 64, 128, 256))]
        if not full and dtype != torch.bfloat16:
            schemes = schemes[:3]  # int8, fp8 and int4 in one group size
        for qw in schemes:
            for rows in (3, 40):
                quant_linear(torch.randn(rows, 256).to(dtype), qw)
        quant_linear(torch.randn(3, 256).to(dtype), schemes[0], torch.randn(64).to(dtype))


def _real_sampling_shapes():
    import torch

    from pagedllm.kernels.sampling import random_uniform, sample
    from pagedllm.reference.ops.sampling import SamplingMetadata, SamplingRow
    for vocab in (3000, 1000):  # tiles of 2048 (8 warps, looped) and of 1024
        logits = torch.randn(3, vocab)
        rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=0.7, top_k=20, stream=5),
                SamplingRow(temperature=1.1, top_p=0.8, blocked_token_ids=[1, 2, 3],
                            num_logprobs=3)]
        sample(logits, SamplingMetadata.from_rows(rows, vocab))
        # logit_bias, the penalties (their own kernel) and min_p
        rows[1] = SamplingRow(temperature=0.9, min_p=0.05, repetition_penalty=1.2,
                              presence_penalty=0.5, frequency_penalty=0.3,
                              logit_bias={4: -100.0}, prompt_token_ids=[1, 2],
                              output_token_ids=[3, 3], stream=6)
        sample(logits, SamplingMetadata.from_rows(rows, vocab))
        # a structured output's grammar: the token bitmask's kernel, before the penalties'
        bitmask = torch.randint(-2**31, 2**31, (3, (vocab + 31) // 32), dtype=torch.int64)
        sample(logits, SamplingMetadata.from_rows(rows, vocab,
                                                  token_bitmask=bitmask.to(torch.int32)))
    random_uniform(torch.tensor([1, 2]), torch.tensor([0, 7]), 300)


def _speculative_decoding(path, dtype):
    """n-gram speculation: runs of proposals verified by the accepted_lengths kernel (the
    engine's launch: runs gathered from the step's sampled tokens), some accepted, some
    rolled back. The prompts are ones whose greedy continuations on the tiny llama3 (seed 0)
    repeat their own tokens, [217, 12, 217, 12, ...] and [42, 42, 42, ...], so the n-gram
    lookup hits."""
    from pagedllm.optimized import SamplingParams as P
    llm = _llm(path, dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 2})
    llm.generate([{"prompt_token_ids": [90, 34, 125, 32, 182, 130, 112, 12]},
                  {"prompt_token_ids": [62, 159, 79, 159, 25, 183, 225, 134]}],
                 P(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)


def _spec_decode_shapes():
    """Verification at every tile width a num_speculative_tokens in [1, 64] gives (BLOCK_K 1 to
    64), contiguous runs and runs sliced out of wider buffers (strides not multiples of 16)."""
    import torch

    from pagedllm.kernels.spec_decode import accepted_lengths
    for K in (1, 2, 3, 7, 16, 31, 64):
        target = torch.randint(0, 4, (3, K + 1))
        accepted_lengths(target, target[:, :K].clone(), torch.tensor([K, K // 2, 0]))
    wide = torch.randint(0, 4, (3, 40))
    accepted_lengths(wide[:, :17], wide[:, 20:36], torch.tensor([16, 3, 9]))


def _mla_decode_shapes():
    """MLA's absorbed decode at DeepSeek-V2's latent (512 + 64), int32 metadata as the engine
    passes it: V2-Lite's 16 heads in each dtype, V2's 128 (8 head blocks) in bf16 and fp16 on a
    mixed batch (a 3-row sequence, a padding row)."""
    import torch

    from pagedllm.kernels.mla_decode import paged_mla_attention
    tables = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 17], dtype=torch.int32)
    for dtype, heads, starts in (
            (torch.bfloat16, 16, [0, 1, 2]), (torch.float16, 16, [0, 1, 2]),
            (torch.float32, 16, [0, 1, 2]), (torch.bfloat16, 128, [0, 3, 4]),
            (torch.float16, 128, [0, 3, 4])):
        rows = starts[-1] + 1  # one padding row
        paged_mla_attention(torch.randn(rows, heads, 512).to(dtype),
                            torch.randn(rows, heads, 64).to(dtype),
                            torch.randn(4, 16, 576).to(dtype), tables, seq_lens,
                            torch.tensor(starts, dtype=torch.int32), 0.1)


def _exercise_shapes():
    """The lessons' Triton exercises (their solutions): lesson 10's paged decode and lesson 13's
    store_kv, at their tests' shapes (fp32, blocks of 4, small heads) and at real models' (bf16
    and fp16, blocks of 16, heads 128 and 80 wide: 80 pads to 128), with int32 and int64 slots."""
    import torch
    attention = exercise_module("triton_paged_attention_exercise")
    store = exercise_module("triton_store_kv_exercise")
    shapes = ((torch.float32, 4, 4, 2, 32), (torch.bfloat16, 16, 32, 8, 128),
              (torch.float16, 16, 8, 8, 80))
    for dtype, block, heads, kv_heads, head_dim in shapes:
        seq_lens = torch.tensor([1, block + 3, 3 * block], dtype=torch.int32)
        need = [-(-int(n) // block) for n in seq_lens]
        num_blocks = sum(need) + 1
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
        v_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
        tables = torch.zeros(len(need), max(need), dtype=torch.int32)
        order, used = torch.randperm(num_blocks).to(torch.int32), 0
        for b, n in enumerate(need):
            tables[b, :n] = order[used:used + n]
            used += n
        q = torch.randn(len(need), heads, head_dim).to(dtype)
        attention.paged_decode(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
        qkv = torch.randn(3, (heads + 2 * kv_heads) * head_dim).to(dtype)  # strided K and V
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(3, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim:].view(3, kv_heads, head_dim)
        for slots in (torch.tensor([0, -1, 5]), torch.tensor([0, -1, 5], dtype=torch.int32)):
            store.store_kv(k, v, k_cache, v_cache, slots)


MATRICES = ("full", "ci", "smoke")
# A quantized KV cache per format through the engine's chunked prefill (prefills, chunks,
# prefix-cache hits and decodes), each with another family and model dtype.
QUANTIZED_RUNS = (("fp8_e4m3", "llama3", "bfloat16"), ("fp8_e5m2", "mistral", "float16"),
                  ("int8", "qwen2", "float32"), ("int4", "qwen3", "bfloat16"))


def record_cases(matrix: str = "full") -> list[Case]:
    """The matrix (the weights are rough seconds, to balance the record processes).

    full: every family in every dtype through the engine, the engine's other paths on a few of
    them, each quantized kv_cache_dtype in every dtype, then the launchers at real models'
    shapes. ci: the same paths in fewer launches, for a test that must finish in minutes
    (compiling is the slow part): each family in one dtype, each dtype in two families, each
    kv_cache_dtype once, the real shapes that bound shared memory and every constexpr branch.
    smoke: one engine run, to walk the path (gpu_check's dry run); it proves nothing of
    coverage.
    """
    if matrix == "smoke":
        return [Case("engine llama float32: mixed batch", "llama",
                     lambda p: _mixed_batch(p, "float32"), 3.0)]
    if matrix == "full":
        runs = [(family, dtype) for family in FAMILIES for dtype in DTYPES]
    elif matrix == "ci":
        runs = [("llama", "float32"), ("llama3", "bfloat16"), ("mistral", "float16"),
                ("qwen2", "bfloat16"), ("qwen3", "float16"), ("opt", "float32")]
    else:
        raise ValueError(f"matrix {matrix!r}: choose one of {MATRICES}")
    full = matrix == "full"
    cases = [Case(f"engine {family} {dtype}: mixed batch", family,
                  lambda p, d=dtype: _mixed_batch(p, d), 3.0) for family, dtype in runs]
    cases += [
        Case("engine llama3 bfloat16: chunked prefill, prefix-cache hits", "llama3",
             lambda p: _chunks_and_prefix_hits(p, "bfloat16"), 5.0),
        Case("engine qwen2 float32: beam search", "qwen2", lambda p: _beam_search(p, "float32"),
             3.0),
        Case("engine llama head_dim 24 float16: mixed batch", "llama-head24",
             lambda p: _mixed_batch(p, "float16"), 3.0),
        Case("direct: paged attention at real head sizes", None,
             _direct(lambda: _real_attention_shapes(full)), 14.0 if full else 6.0),
        Case("direct: paged attention over quantized caches", None,
             _direct(lambda: _quantized_attention_shapes(full)), 30.0 if full else 4.0),
        Case("direct: small ops at real widths", None, _direct(_real_small_op_shapes), 2.0),
        Case("direct: sampling at real vocabularies", None, _direct(_real_sampling_shapes), 1.0),
        Case("direct: speculative decoding's verification", None,
             _direct(_spec_decode_shapes), 1.0),
        Case("engine llama3 bfloat16: speculative decoding (n-gram)", "llama3",
             lambda p: _speculative_decoding(p, "bfloat16"), 3.0),
        Case("direct: weight-only quantized products", None,
             _direct(lambda: _quant_linear_shapes(full)), 3.0),
        Case("direct: MLA decode at DeepSeek-V2's sizes", None, _direct(_mla_decode_shapes),
             2.0),
    ]
    if EXERCISES.is_dir():
        cases.append(Case("direct: the lessons' Triton exercises (solutions)", None,
                          _direct(_exercise_shapes), 2.0))
    quantized = ([(kv, family, dtype) for kv, family, _ in QUANTIZED_RUNS for dtype in DTYPES]
                 if full else QUANTIZED_RUNS)
    cases += [Case(f"engine {family} {dtype} kv_cache_dtype {kv}: chunked prefill, prefix-cache "
                   f"hits", family, lambda p, d=dtype, kv=kv: _chunks_and_prefix_hits(p, d, kv),
                   5.0) for kv, family, dtype in quantized]
    return cases


def _shards(cases: list[Case], n: int) -> list[list[int]]:
    """Case indices split into n groups of about equal weight, a checkpoint's cases together
    (each record process writes the checkpoints it needs)."""
    groups: dict = {}
    for i, case in enumerate(cases):
        groups.setdefault(case.checkpoint or case.name, []).append(i)
    shards, loads = [[] for _ in range(n)], [0.0] * n
    for group in sorted(groups.values(), key=lambda g: -sum(cases[i].weight for i in g)):
        lightest = loads.index(min(loads))
        shards[lightest] += group
        loads[lightest] += sum(cases[i].weight for i in group) + 2.0  # + writing a checkpoint
    return [sorted(s) for s in shards]


def record_shard(indices: list[int], workdir: Path, matrix: str = "full") -> list[dict]:
    """Run these cases under the interpreter (in this process) and return their launches."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the record phase runs under the interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported")
    from pagedllm.kernels.runtime import launch_hook
    from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
    cases = record_cases(matrix)
    recorder = Recorder()
    written = {}
    with launch_hook(recorder):
        for i in indices:
            case = cases[i]
            path = None
            if case.checkpoint is not None:
                if case.checkpoint not in written:
                    family, overrides = CHECKPOINTS[case.checkpoint]
                    written[case.checkpoint] = write_random_checkpoint(
                        workdir / case.checkpoint, tiny_config(family, **overrides), seed=0,
                        init_std=0.2)  # a trained model's spread of logits, as the tests'
                path = written[case.checkpoint]
            recorder.case = case.name
            start = time.time()
            case.run(path)
            print(f"  recorded {case.name} ({time.time() - start:.1f} s)", file=sys.stderr)
    return list(recorder.launches.values())


def _merge(launch_lists) -> list[dict]:
    merged = {}
    for launch in itertools.chain.from_iterable(launch_lists):
        key = json.dumps([launch[k] for k in ("kernel", "signature", "constexprs", "attrs",
                                              "options")], sort_keys=True)
        if key in merged:
            merged[key]["count"] += launch["count"]
        else:
            merged[key] = dict(launch)
    return sorted(merged.values(), key=lambda x: (x["kernel"], json.dumps(x, sort_keys=True)))


def record(matrix: str = "full", jobs: int = 2, workdir: str | None = None) -> list[dict]:
    """Phase 1 in `jobs` fresh interpreter processes (this one interprets nothing)."""
    cases = record_cases(matrix)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(workdir or tmp)
        procs = []
        for k, shard in enumerate(_shards(cases, max(1, min(jobs, len(cases))))):
            out = workdir / f"launches-{k}.json"
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            cmd = [sys.executable, "-m", f"{PACKAGE}.compile_check", "record-shard",
                   "--matrix", matrix, "--cases", ",".join(map(str, shard)),
                   "--workdir", str(workdir / f"shard-{k}"), "--out", str(out)]
            procs.append((subprocess.Popen(cmd, env=env), out))
        failed = [p.args for p, _ in procs if p.wait() != 0]
        if failed:
            raise RuntimeError(f"record processes failed: {failed}")
        return _merge(json.loads(out.read_text()) for _, out in procs)


# -- phase 2: compile ---------------------------------------------------------------------------
def _import_kernel(qualified: str):
    import importlib
    module, name = qualified.split(":")
    if module.startswith(f"{EXERCISE_MODULE}."):  # a lesson's exercise: not in the package
        return getattr(exercise_module(module.removeprefix(f"{EXERCISE_MODULE}.")), name)
    return getattr(importlib.import_module(module), name)


_USAGE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _parse_ptxas(log: str) -> dict | None:
    used, spills = _USAGE.search(log), _SPILLS.search(log)
    if used is None:
        return None
    return {"registers": int(used.group(1)),
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0}


def _ptxas_usage(ptx: str, capability: int) -> dict:
    """Registers and spills from ``ptxas -v`` on the PTX, with Triton's flags: Triton's ptxas
    for this target first (``ptxas`` below sm_90, ``ptxas-blackwell`` from sm_90 on), then the
    other one Triton ships, for a PTX the first rejects."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    first = get_ptxas(capability).path
    tools = [first, *(t.path for t in (knobs.nvidia.ptxas, knobs.nvidia.ptxas_blackwell)
                      if t.path != first)]
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for ptxas in tools:
            done = subprocess.run(
                [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2",
                 f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
                 "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
            usage = _parse_ptxas(done.stderr + done.stdout) if done.returncode == 0 else None
            if usage is not None:
                return {"ptxas": Path(ptxas).name, **usage}
            errors.append(f"{Path(ptxas).name}: {(done.stderr or done.stdout).strip()[-200:]}")
    return {"ptxas": None, "ptxas_errors": errors}


def compile_launch(launch: dict, capability: int) -> dict:
    """Compile one recorded launch for one target; never raises: a failure is a result."""
    import contextlib
    import io

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import ASTSource
    target = TARGETS[capability]
    result = {"kernel": launch["kernel"].split(":")[1], "target": target.arch,
              "capability": capability, "constexprs": launch["constexprs"],
              "case": launch.get("case"), "launch": launch}
    start = time.time()
    printed = io.StringIO()
    try:
        fn = _import_kernel(launch["kernel"])
        attrs = {(fn.arg_names.index(name),): [tuple(a) for a in value]
                 for name, value in launch["attrs"].items()}
        src = ASTSource(fn, launch["signature"], constexprs=launch["constexprs"], attrs=attrs)
        # Triton runs `ptxas -v` for the cubin and prints its log when asked to: reading it
        # saves running ptxas again (a kernel from Triton's cache prints nothing; then we do).
        knobs.nvidia.dump_ptxas_log = True
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")  # TRITON_DEFAULT_FP_FUSION's notice
            compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                      options=launch["options"])
    except Exception as error:  # the compiler's message is the point of the report
        return {**result, "ok": False, "error": f"{type(error).__name__}: {error}".strip(),
                "seconds": round(time.time() - start, 2)}
    md = compiled.metadata
    usage = _parse_ptxas(printed.getvalue())
    if usage is not None:
        usage = {"ptxas": Path(get_ptxas(capability).path).name, **usage}
    else:
        usage = _ptxas_usage(compiled.asm["ptx"], capability)
    shared = md.shared or 0
    over = shared > target.smem_per_program
    return {**result, "ok": not over,
            "error": f"shared memory {shared} B > {target.smem_per_program} B per program on "
                     f"{target.arch}" if over else None,
            "shared": shared, "shared_limit": target.smem_per_program,
            "num_warps": md.num_warps, "num_stages": md.num_stages, **usage,
            **occupancy(target, md.num_warps, usage.get("registers"), shared),
            "seconds": round(time.time() - start, 2)}


def occupancy(target: Target, num_warps: int, registers: int | None, shared: int) -> dict:
    """Programs resident on one multiprocessor at once, and which resource decides it."""
    limits = {"warps": target.max_warps_per_sm // num_warps,
              "programs": target.max_programs_per_sm,
              "shared": target.smem_per_sm // (shared + target.reserved_smem)}
    if registers is not None:
        per_warp = math.ceil(registers * 32 / 256) * 256  # a warp's registers, 256 at a time
        limits["registers"] = (target.regs_per_sm // per_warp) // num_warps
    programs = min(limits.values())
    return {"programs_per_sm": programs,
            "limited_by": [k for k, v in limits.items() if v == programs],
            "occupancy": programs * num_warps / target.max_warps_per_sm}


def _cost(job) -> float:
    """A guess at a compile's seconds, to start the slow ones first: paged attention's matrix
    products, most of all fp32's (no tensor cores: unrolled FMAs)."""
    launch, _ = job
    c = launch["constexprs"]
    if not launch["kernel"].endswith(":_paged_attention_kernel"):
        return 2.0 if "BLOCK_M" in c else 1.0  # the weight-only products: a small tl.dot
    fp32 = launch["signature"]["q_ptr"] == "*fp32"
    return c["BLOCK_M"] * c["HEAD_PAD"] * c["TILE_N"] * (8 if fp32 else 1)


def _compile_job(job):
    return compile_launch(*job)


def compile_all(launches: list[dict], capabilities=(80, 90, 100), jobs: int = 2) -> list[dict]:
    """Phase 2: every launch for every target, in `jobs` fresh worker processes."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the compile phase must run without TRITON_INTERPRET")
    work = sorted(((launch, cap) for launch in launches for cap in capabilities), key=_cost,
                  reverse=True)
    if jobs <= 1:
        return [_compile_job(job) for job in work]
    import multiprocessing
    # forkserver: each worker starts from a clean process, never one that interpreted a kernel.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return list(pool.map(_compile_job, work))


# -- the report ---------------------------------------------------------------------------------
def summarize(results: list[dict]) -> list[dict]:
    """One row per kernel and target: the worst case over its launches."""
    rows = {}
    for r in results:
        row = rows.setdefault((r["kernel"], r["capability"]), {
            "kernel": r["kernel"], "target": r["target"], "capability": r["capability"],
            "launches": 0, "failed": 0,
            "shared_max": None, "shared_limit": TARGETS[r["capability"]].smem_per_program,
            "registers_max": None, "spills_max": None, "programs_per_sm_min": None,
            "occupancy_min": None, "ptxas": set()})
        row["launches"] += 1
        row["failed"] += not r["ok"]
        if "shared" not in r:
            continue  # did not compile
        row["shared_max"] = max(row["shared_max"] or 0, r["shared"])
        row["ptxas"].add(r.get("ptxas") or "none")
        if r.get("registers") is not None:
            row["registers_max"] = max(row["registers_max"] or 0, r["registers"])
            row["spills_max"] = max(row["spills_max"] or 0, r["spill_stores"] + r["spill_loads"])
        for key, value in (("programs_per_sm_min", r["programs_per_sm"]),
                           ("occupancy_min", r["occupancy"])):
            row[key] = value if row[key] is None else min(row[key], value)
    for row in rows.values():
        row["ptxas"] = ",".join(sorted(row["ptxas"])) or "-"
    return sorted(rows.values(), key=lambda row: (row["kernel"], row["capability"]))


def _kib(n) -> str:
    return "-" if n is None else f"{n / 1024:.1f}"


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def format_summary(rows: list[dict]) -> str:
    """The table: per kernel and target, its worst launch in each column."""
    lines = [f"{'kernel':<24} {'target':<8} {'launches':>8} {'failed':>6} {'smem KiB':>8} "
             f"{'limit':>6} {'regs':>5} {'spills B':>8} {'progs/SM':>8} {'occup.':>6}  ptxas"]
    for row in rows:
        occupancy = "-" if row["occupancy_min"] is None else f"{row['occupancy_min']:.0%}"
        lines.append(
            f"{row['kernel']:<24} {row['target']:<8} {row['launches']:>8} {row['failed']:>6} "
            f"{_kib(row['shared_max']):>8} {_kib(row['shared_limit']):>6} "
            f"{_or_dash(row['registers_max']):>5} {_or_dash(row['spills_max']):>8} "
            f"{_or_dash(row['programs_per_sm_min']):>8} {occupancy:>6}  {row['ptxas']}")
    return "\n".join(lines)


_SHAPE_KEYS = ("HEAD_DIM", "GROUP", "BLOCK_M", "TILE_N", "NUM_SPLITS", "SLIDING", "BLOCK",
               "BLOCK_D", "BLOCK_H", "BLOCK_HALF", "CHUNK", "USE_TABLE", "HAS_RESIDUAL",
               "KV_FORMAT")


def _dtype(launch: dict) -> str:
    """The element type of the first floating-point pointer argument."""
    return next((t[1:] for t in launch["signature"].values()
                 if t.startswith("*") and t[1] in "fb"), "-")


def _shape(constexprs: dict) -> str:
    """The constexprs that shape a program, a flag by its name when on (off: left out)."""
    return " ".join(k if v is True else f"{k}={v}" for k, v in constexprs.items()
                    if k in _SHAPE_KEYS and v is not False and v != "auto")


def format_launches(results: list[dict], kernel: str) -> str:
    """Every compiled launch of one kernel: its dtype, shape constexprs and resources."""
    picked = sorted((r for r in results if r["kernel"] == kernel), key=lambda r: (
        r["capability"], _dtype(r["launch"]), json.dumps(r["constexprs"], sort_keys=True)))
    width = max([len("constexprs"), *(len(_shape(r["constexprs"])) for r in picked)])
    lines = [f"{'target':<8} {'dtype':<5} {'constexprs':<{width}} {'warps':>5} {'smem KiB':>8} "
             f"{'regs':>4} {'spills B':>8} {'progs/SM':>8}"]
    for r in picked:
        head = f"{r['target']:<8} {_dtype(r['launch']):<5} {_shape(r['constexprs']):<{width}}"
        if "shared" not in r:
            lines.append(f"{head} FAILED: {r['error'].splitlines()[-1][:60]}")
            continue
        spills = r.get("spill_stores", 0) + r.get("spill_loads", 0)
        lines.append(f"{head} {r['num_warps']:>5} {_kib(r['shared']):>8} "
                     f"{_or_dash(r.get('registers')):>4} {spills:>8} {r['programs_per_sm']:>8}"
                     + ("" if r["ok"] else f"  FAILED: {r['error']}"))
    return "\n".join(lines)


def format_failures(results: list[dict]) -> str:
    return "\n\n".join(
        f"{r['kernel']} for {r['target']} (recorded in: {r.get('case')})\n"
        f"  constexprs: {r['constexprs']}\n  signature: {r['launch']['signature']}\n"
        f"  options: {r['launch']['options']}\n  error: {r['error']}"
        for r in results if not r["ok"])


# -- command line -------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagedllm.kernels.compile_check",
        description="Record every kernel launch under the interpreter, compile each for real "
                    "GPUs in a fresh process, and report shared memory, registers, spills and "
                    "occupancy.")
    parser.add_argument("phase", nargs="?", default="all",
                        choices=["all", "record", "compile", "record-shard"],
                        help="all (default): record, then compile; or one phase")
    parser.add_argument("--matrix", default="full", choices=MATRICES,
                        help="what the record phase runs (default: %(default)s)")
    parser.add_argument("--launches", help="the recorded launches, JSON (record: written; "
                        "compile: read; all: written if given)")
    parser.add_argument("--json", help="write the compile results and the table here")
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)),
                        help="compute capabilities to compile for (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8),
                        help="processes per phase (default: %(default)s)")
    parser.add_argument("--kernel", help="also list every launch of this kernel")
    parser.add_argument("--cases", help=argparse.SUPPRESS)  # record-shard: case indices
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase == "record-shard":
        indices = [int(i) for i in args.cases.split(",") if i]
        launches = record_shard(indices, Path(args.workdir), args.matrix)
        Path(args.out).write_text(json.dumps(launches))
        return 0
    if args.phase in ("all", "record"):
        start = time.time()
        launches = record(args.matrix, args.jobs)
        print(f"recorded {len(launches)} distinct launches in {time.time() - start:.0f} s",
              file=sys.stderr)
        if args.launches:
            Path(args.launches).write_text(json.dumps(launches, indent=1))
        if args.phase == "record":
            return 0
    else:
        launches = json.loads(Path(args.launches).read_text())
    start = time.time()
    capabilities = [int(c) for c in args.targets.split(",")]
    results = compile_all(launches, capabilities, args.jobs)
    print(f"compiled {len(results)} (launch, target) pairs in {time.time() - start:.0f} s",
          file=sys.stderr)
    rows = summarize(results)
    print(format_summary(rows))
    if args.kernel:
        print(f"\n{args.kernel}, each launch:\n" + format_launches(results, args.kernel))
    failures = format_failures(results)
    if failures:
        print("\nFAILED\n\n" + failures)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": rows, "results": results}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
