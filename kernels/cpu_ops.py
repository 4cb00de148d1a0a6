"""The CPU kernels (``kernels/cpu/*.cpp``) as the CPU backend's ops, and the weights' packing.

Without Triton (a CPU, no interpreter) torch's kernels for a decode step's shapes were the
measured limit (lesson 18):

- **products**: torch's int4 kernel reads its codes at about 1.2 GB/s at 16 rows on an AMD
  EPYC (Zen 4, one thread), slower than bf16 ``F.linear`` on four times the bytes, and
  oneDNN's bf16 product of one row reads about 6 GB/s of a 24-30 GB/s memory. ``int4_matmul``
  turns the codes into floats inside the registers; ``bf16_matmul`` is the same loop on bf16
  weights (the LM head above all); ``int8_matmul`` multiplies the int8 codes as they are
  stored (AVX-512: VNNI's ``vpdpbusd``, the rows written as 24-bit integers in three byte
  planes); ``fp8_matmul`` turns each e4m3 code into an fp16 number with two integer operations
  (a shift and an AND) and widens it with F16C's ``vcvtph2ps``, no table.
- **the small ops of a layer**: RMSNorm (ten operators in the twin), the K/V write (a check
  and two indexed copies), rotary (three), and a decode step's attention (a gather of the
  blocks, a mask, two batched products and a softmax: ``paged_decode_attention`` reads the
  blocks in place). Each is one pass with the twin's roundings, or in float32 where the
  comment says so.

Each kernel has three paths (``cpu/cpu.h``): AVX-512 with BF16 and VNNI, AVX2 with FMA, and
portable C++, and the bf16 product a fourth, AMX tiles (``amx``: the AVX-512 path with them);
the best one this CPU has is taken at run time (``cpu_isa()``; ``use_isa()`` caps it, for
tests). Each op below is a ``CpuOp``: the kernel where its inputs are ones it
takes, the twin otherwise (the condition is in the op, once).

Built on first use with torch's extension builder (a C++ compiler and ninja; a minute or two
on two cores, then cached); where the build fails, ``cpu_kernels_status()`` says why and every
op is its twin.

The products' packed layouts: for each block of 16 outputs, the inputs in pairs (int8: in
fours), so that one 512-bit register holds 16 outputs x 2 inputs (32 bf16), the operand of one
``vdpbf16ps``.
- bf16: ``[N / 16, K / 2, 16, 2]`` (a reshuffle of ``W [N, K]``, the same bytes).
- int8: ``[N / 16, K / 4, 16, 4]`` codes, four inputs of an output in a 32-bit lane (the
  operand of one VNNI ``vpdpbusd``); the scale per output in float32 and the sum of each
  output's codes in int32, ``[N]``.
- int4: ``[N / 16, K / 4, 32]`` bytes: byte ``2n + j`` of a 32-byte run holds the codes of
  output n, inputs ``4i + j`` (low nibble) and ``4i + 2 + j`` (high nibble); the scales and
  zero points in bf16, ``[N / 16, K / group, 16]``: the twin's bytes, reordered.
- fp8: ``[N / 16, K, 16]`` e4m3 codes as uint8: per block of 16 outputs, input k's 16 codes in
  a row, so that one load and one ``vcvtph2ps`` give the 16 outputs' weights for input k as
  float32 (the fp8 product multiplies in float32 on every path, a bf16 x widened once: no
  pairs). The scale per output in float32, NaN for a row that holds a NaN code (0x7F, 0xFF:
  the kernel's conversion reads those as 1.875 x 2^8, a NaN scale makes the row's outputs NaN
  as the twin's are, at no cost a product).
"""

import contextlib
import functools
import hashlib
import logging
import os
import sys

import torch

from pagedllm.reference.ops import rms_norm as rms_norm_reference
from pagedllm.reference.ops import silu_and_mul as silu_and_mul_reference
from pagedllm.reference.ops import store_kv as store_kv_reference
from pagedllm.reference.ops.weight_quant import QuantizedWeight

log = logging.getLogger(__name__)
SOURCE_DIR = os.path.join(os.path.dirname(__file__), "cpu")
SOURCES = sorted(os.path.join(SOURCE_DIR, name) for name in os.listdir(SOURCE_DIR)
                 if name.endswith(".cpp"))
ISAS = ("amx", "avx512", "avx2", "scalar")  # the kernels' paths, best first (cpu/cpu.h)
# The path the kernels are capped at (none by default): PAGEDLLM_CPU_ISA for a whole process
# (to measure another CPU's path), use_isa() inside a block (tests).
_cap = "amx"


@functools.cache
def _extension_name() -> str:
    """The module's name, keyed by the sources' bytes: two checkouts (or an old one) with other
    sources build beside each other instead of rebuilding one cached module in turn."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(SOURCE_DIR)):
        if name.endswith((".cpp", ".h")):
            with open(os.path.join(SOURCE_DIR, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return f"pagedllm_cpu_ops_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _build_lock(built: str):
    """One builder at a time, and no wait on a dead one. torch's builder marks a build with a
    ``lock`` file and waits, without limit, for it to go; a builder killed mid-build (a Ctrl-C, a
    test's timeout) leaves it behind and every later process would hang. An OS lock is released
    when its process dies, so whoever holds it knows a ``lock`` file left there is stale."""
    import fcntl  # POSIX: elsewhere the import fails inside _build, which then says why

    os.makedirs(os.path.dirname(built), exist_ok=True)
    with open(built + ".build-lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(built, "lock")
            if os.path.exists(stale):
                log.warning("pagedllm: removing %s, left by a build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_directory() -> str:
    """Where torch's extension builder keeps the built kernels of these sources: under
    ``TORCH_EXTENSIONS_DIR`` when it is set, else under torch's cache in a folder per Python
    version and device (torch's own rule)."""
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        device = f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else \
            f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        version = f"py{sys.version_info.major}{sys.version_info.minor}"
        root = os.path.join(get_default_build_root(),
                            f"{version}{getattr(sys, 'abiflags', '')}_{device}")
    return os.path.join(root, _extension_name())


@functools.cache
def _build():
    """(the built module, None) or (None, why it could not be built)."""
    try:
        from torch.utils.cpp_extension import load
        built = build_directory()
        name = os.path.basename(built)
        if not os.path.exists(os.path.join(built, name + ".so")):  # why the first use waits
            log.warning("pagedllm: building the CPU kernels (first use: a minute or two on two "
                        "cores, then cached under %s)", built)
        with _build_lock(built):
            module = load(name, SOURCES, extra_cflags=["-O3"],
                          extra_include_paths=[SOURCE_DIR], verbose=False)
    except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels instead
        first = str(e).splitlines()[0] if str(e) else ""
        reason = f"the CPU kernels did not build ({type(e).__name__}: {first})"
        log.warning("pagedllm: %s; using torch's kernels", reason)
        return None, reason
    cap = os.environ.get("PAGEDLLM_CPU_ISA")
    if cap:  # a benchmark of another CPU's path (e.g. avx2 on an AVX-512 machine)
        if cap not in ISAS:
            raise ValueError(f"PAGEDLLM_CPU_ISA must be one of {ISAS}, got {cap!r}")
        global _cap
        _cap = cap
        module.set_isa(cap)
    return module, None


def cpu_extension():
    """The built extension module (its ``DecodeStack`` among others), or None where this
    machine cannot build it (``cpu_kernels_status()`` says why)."""
    return _build()[0]


def cpu_kernels_status() -> str:
    """One line: which path the CPU kernels take on this machine, or why none runs."""
    module, reason = _build()
    if module is None:
        return reason
    return f"{module.isa()} path (this CPU runs up to {module.machine_isa()})"


def cpu_isa() -> str | None:
    """The path the kernels take now (``amx``, ``avx512``, ``avx2``, ``scalar``), None without
    a build. ``amx`` is the AVX-512 path with the bf16 product on AMX tiles."""
    module, _ = _build()
    return None if module is None else module.isa()


@contextlib.contextmanager
def use_isa(name: str):
    """Run the CPU kernels' ``name`` path (or the machine's best below it) inside the block:
    how the tests run every path this machine has. Yields the path taken."""
    global _cap
    if name not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {name!r}")
    module, reason = _build()
    if module is None:
        raise RuntimeError(reason)
    before, _cap = _cap, name
    module.set_isa(name)
    try:
        yield module.isa()
    finally:
        _cap = before
        module.set_isa(before)


def cpu_kernels():
    """The kernels' operators (``torch.ops.pagedllm_cpu``), or None where this CPU or machine
    cannot run them."""
    return None if cpu_extension() is None else torch.ops.pagedllm_cpu


def packable(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % 16 == 0


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> [N / 16, K / 2, 16, 2]: per block of 16 outputs, the inputs in pairs."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).contiguous()


def unpack_bf16_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of W [N, K] read from its packed form: an embedding tied to a packed LM head."""
    nb, k2, _, _ = packed.shape
    return packed[rows // 16, :, rows % 16, :].reshape(*rows.shape, k2 * 2)  # [..., K]


def pack_int8(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin's int8 codes in the kernel's layout, its scales in float32 (exactly) and each
    output's sum of codes (the kernel's correction for its unsigned top plane)."""
    n, k = qw.shape
    packed = qw.qweight.reshape(n // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
    return packed, qw.scales.float(), qw.qweight.sum(dim=1, dtype=torch.int32)


def pack_fp8(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's e4m3 codes in the kernel's layout (their bytes, reordered) and its scales in
    float32 (exactly), NaN for a row holding a NaN code."""
    n, k = qw.shape
    codes = qw.qweight.view(torch.uint8)  # [N, K], the e4m3 bit patterns
    packed = codes.reshape(n // 16, 16, k).transpose(1, 2).contiguous()  # [N/16, K, 16]
    nan_rows = ((codes & 0x7F) == 0x7F).any(dim=1)  # [N]
    scales = torch.where(nan_rows, torch.nan, qw.scales.float())  # [N]
    return packed, scales


def pack_int4(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin's int4 codes, scales and zero points in the kernel's layout."""
    n, k = qw.shape
    codes = torch.stack([qw.qweight & 0xF, qw.qweight >> 4], dim=-1).view(n, k)  # [N, K]
    # [N/16, 16 outputs, K/4, 2 (low: inputs 4i, 4i+1 | high: 4i+2, 4i+3), 2 (j)]
    codes = codes.view(n // 16, 16, k // 4, 2, 2).permute(0, 2, 3, 1, 4)  # [nb, K/4, 2, 16, 2]
    low, high = codes[:, :, 0].reshape(n // 16, k // 4, 32), codes[:, :, 1].reshape(
        n // 16, k // 4, 32)
    packed = (low | (high << 4)).contiguous()  # [N/16, K/4, 32] uint8
    groups = k // qw.group_size

    def per_block(t):  # [N, G] -> [N/16, G, 16] bf16
        return t.to(torch.bfloat16).view(n // 16, 16, groups).transpose(1, 2).contiguous()

    return packed, per_block(qw.scales), per_block(qw.zeros)


class CpuOp:
    """An op of the CPU backend: a function with its twin's signature that runs a CPU kernel
    where its inputs are ones the kernel takes. The one-call decode step strings the kernels
    together itself, so it stands in only for a backend whose ops are all CpuOps (a wrapper, a
    timer or a failing op swapped in is a plain function, and runs as the modules call it)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CpuOp({self.fn.__module__}.{self.fn.__qualname__})"


FLOATS = (torch.bfloat16, torch.float32)  # the dtypes the kernels take


@CpuOp
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's ``rms_norm`` (same arguments, same roundings) in one pass a row, for bf16 or
    float32 rows and a weight of their dtype; any other input goes to the twin."""
    kernels = cpu_kernels()
    if (kernels is None or x.dtype not in FLOATS or weight.dtype != x.dtype
            or weight.numel() != x.shape[-1] or (residual is not None and (
                residual.shape != x.shape or residual.dtype != x.dtype))):
        return rms_norm_reference(x, weight, eps, residual)
    if residual is None:
        return kernels.rms_norm(x.contiguous(), weight, eps), x  # the new residual is x
    return kernels.add_rms_norm(x.contiguous(), residual.contiguous(), weight, eps)


def _head_rows(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] bf16 or float32 whose rows hold their heads contiguously (any row
    stride: the K and V of a merged QKV product are views of it)."""
    return (x.dtype in FLOATS and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2])


@CpuOp
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """The twin's ``store_kv``: a row copy per token for an unquantized cache of the rows'
    dtype (a slot outside the cache is refused, as the twin's indexing refuses it); any other
    format or layout goes to the twin."""
    kernels = cpu_kernels()
    if (kernels is None or kv_cache_dtype != "auto" or k_cache.dtype != k.dtype
            or not (_head_rows(k) and _head_rows(v) and k_cache.is_contiguous()
                    and v_cache.is_contiguous())):
        return store_kv_reference(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype,
                                  k_scale, v_scale)
    kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)


def rotary_with_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rotate_half`` of q and k (optimized/attention.py) in one pass, bit for bit, for
    bf16 or float32 heads of even head_dim; None where the kernel does not apply."""
    if not (_head_rows(q) and _head_rows(k) and q.shape[2] % 2 == 0
            and k.shape[2] == q.shape[2] and cos.dtype == sin.dtype == q.dtype == k.dtype):
        return None
    kernels = cpu_kernels()
    return None if kernels is None else kernels.rotary(q, k, cos.contiguous(),
                                                       sin.contiguous())


@CpuOp
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The twin itself (two ATen operators, already one pass each); a CpuOp so that the
    one-call decode step, which computes it with the same operators, may stand in for it."""
    return silu_and_mul_reference(x)


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (``reference/engine/config.py``)."""
    from pagedllm.reference.engine.config import native_bf16 as probe
    return probe()
