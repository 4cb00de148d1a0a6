"""The optimized tier's two backends, peers, and the one place that chooses between them.

A ``Backend`` (``reference/ops/__init__.py``) carries every op this tier swaps: the per-call
ops, how the linear layers multiply (``process_weights``), the step's attention context, and an
optional whole-step slot. The runner asks ``select_backend`` once, when it is built, unless the
engine was handed a backend (a test's failing op, a timer): then that one runs as it is.

- ``TRITON_BACKEND``: the Triton kernels (``kernels/<op>.py``) on CUDA, their quantized
  products dequantizing in registers, an attention context handing the kernel device-side
  lengths, CUDA graphs for decode steps, asynchronous swaps. Under ``TRITON_INTERPRET=1`` the
  same kernels run on CPU tensors in Triton's interpreter (how CI checks them), without the
  graphs and with host-side lengths.
- ``CPU_BACKEND``: the C++ kernels (``kernels/cpu/<op>.cpp``: AVX-512, AVX2 or portable C++,
  whichever this CPU runs best), the weights packed for them, attention planned once per step,
  and the decode step's layers in one C++ call.

``describe(backend, dtype)`` says, op by op, what computes it on this machine and why;
``LLM.kernels()`` and ``pagedllm env`` print it.
"""

from dataclasses import replace

import torch

from pagedllm.kernels import cpu_ops
from pagedllm.kernels.backend import TRITON_OPS
from pagedllm.kernels.runtime import interpreting
from pagedllm.reference.ops import Backend, copy_blocks, sample
from pagedllm.reference.ops import swap_blocks as swap_blocks_reference

from .attention import cpu_paged_attention, cpu_rotary
from .cuda_graphs import CudaGraphs, DeviceAttention
from .decode_step import DecodeStep
from .quant_layers import pack_linears_for_cpu, triton_quantized_linears


# --8<-- [start:swap_blocks]
def swap_blocks(src: torch.Tensor, dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """The twin's result (reference/ops/cache_ops.py). Between a CUDA pool and a pinned
    CPU pool it queues one asynchronous copy per block, as vLLM's swap_blocks does (a
    cudaMemcpyAsync per block): the host goes on to the forward while the bus moves the
    blocks.

    Waiting is never needed, because the copies sit on the current stream. The forward
    that overwrites a swapped-out block is queued after the copy reading it, and a
    swap-in's copy before the forward reading its blocks. Only pinned (page-locked) host
    memory can take part in an asynchronous copy; from pageable memory CUDA copies
    synchronously.
    """
    cpu = dst if src.is_cuda else src
    if src.device == dst.device or not cpu.is_pinned():
        return swap_blocks_reference(src, dst, block_mapping)
    for s, d in block_mapping.tolist():
        # one block: [block_size, kv_heads, head_dim]
        dst[d].copy_(src[s], non_blocking=True)
# --8<-- [end:swap_blocks]


# --8<-- [start:backends]
TRITON_BACKEND = replace(TRITON_OPS, name="triton", swap_blocks=swap_blocks,
                         process_weights=triton_quantized_linears,
                         attention_context=DeviceAttention, whole_step=CudaGraphs.build)
# The same kernels in Triton's interpreter, on CPU tensors: the reference's
# context (host-side lengths) and no graphs.
INTERPRETED_BACKEND = replace(TRITON_BACKEND, name="triton-interpreter",
                              attention_context=None, whole_step=None)

CPU_BACKEND = Backend(
    name="cpu", store_kv=cpu_ops.store_kv, paged_attention=cpu_paged_attention,
    copy_blocks=copy_blocks, swap_blocks=swap_blocks_reference,
    rms_norm=cpu_ops.rms_norm, rotary=cpu_rotary,
    silu_and_mul=cpu_ops.silu_and_mul, sample=sample,
    process_weights=pack_linears_for_cpu, whole_step=DecodeStep.for_runner)


def select_backend(device: torch.device) -> Backend:
    """The backend for a model on `device`: decided here, once, when the runner is
    built."""
    if device.type == "cuda":
        return TRITON_BACKEND
    if interpreting():
        return INTERPRETED_BACKEND
    return CPU_BACKEND
# --8<-- [end:backends]


def describe(backend: Backend, dtype: torch.dtype) -> dict[str, str]:
    """What computes each op of `backend` on this machine for a model in `dtype`, and why."""
    if backend.name == "cpu":
        return _describe_cpu(dtype)
    if backend.name.startswith("triton"):
        where = "on CUDA" if backend.name == "triton" else \
            "in Triton's interpreter, on CPU tensors (TRITON_INTERPRET=1)"
        report = {op: f"Triton kernel (kernels/{op}.py), {where}"
                  for op in ("store_kv", "paged_attention", "copy_blocks", "rms_norm", "rotary",
                             "silu_and_mul", "sample")}
        report["accepted_lengths"] = (f"Triton kernel (kernels/spec_decode.py): speculative "
                                      f"decoding's verification, {where}")
        report["linear"] = (f"int8/int4/fp8/GGUF: Triton kernel dequantizing in registers "
                            f"(kernels/quant_linear.py), {where}; float weights: torch "
                            f"(cuBLAS on CUDA)")
        report["whole_step"] = "CUDA graphs: a decode step replayed in one launch" \
            if backend.whole_step else "none: the interpreter cannot capture graphs"
        return report
    return {"every op": f"backend {backend.name!r} as the engine was handed it "
                        f"(EngineArgs.backend)"}


def _describe_cpu(dtype: torch.dtype) -> dict[str, str]:
    isa = cpu_ops.cpu_isa()
    if isa is None:
        why = cpu_ops.cpu_kernels_status()
    elif dtype not in cpu_ops.FLOATS:
        why = (f"the CPU kernels take "
               f"{', '.join(str(d).removeprefix('torch.') for d in cpu_ops.FLOATS)}")
    else:
        why = None
    planned = ("padded batches planned once per step, torch's fused attention "
               "(optimized/attention.py)")
    if why is None:
        # the amx path is the avx512 one but for the bf16 product (_cpu_linear says so)
        kernel = f"C++ kernel, {'avx512' if isa == 'amx' else isa} path"
        return {
            "rms_norm": f"{kernel}; kernels/cpu/rms_norm.cpp",
            "store_kv": f"{kernel}; kernels/cpu/store_kv.cpp",
            "rotary": f"{kernel}; kernels/cpu/rotary.cpp, cos/sin once per step",
            "paged_attention": f"decodes with head_dim 32 or 64: {kernel}; "
                               f"kernels/cpu/paged_attention.cpp. Other head sizes, prompts, "
                               f"chunks and quantized caches: {planned}",
            **_cpu_common(dtype, isa),
            "whole_step": "the decode step's layers in one C++ call "
                          "(kernels/cpu/decode_step.cpp) for " + DecodeStep.requirements(),
        }
    return {
        "rms_norm": f"the torch twin (reference/ops): {why}",
        "store_kv": f"the torch twin (reference/ops): {why}",
        "rotary": f"torch, cos/sin once per step (optimized/attention.py): {why}",
        "paged_attention": f"{planned}: {why}",
        **_cpu_common(dtype, isa),
        "whole_step": f"none: {why}",
    }


def _cpu_common(dtype: torch.dtype, isa: str | None) -> dict[str, str]:
    return {"silu_and_mul": "ATen's silu and mul (the twin): one pass each already",
            "sample": "the torch twin: vectorized already",
            "accepted_lengths": "the torch twin: a few integers per speculative run",
            "copy_blocks, swap_blocks": "the torch twins: copies, not kernels",
            "linear": _cpu_linear(dtype, isa)}


def _cpu_linear(dtype: torch.dtype, isa: str | None) -> str:
    if isa is None or dtype not in cpu_ops.FLOATS:
        why = cpu_ops.cpu_kernels_status() if isa is None else f"a {dtype} model"
        return (f"F.linear for float weights; int8/int4/GGUF: torch's weight-only kernels or "
                f"the twin ({why}); fp8: the twin (torch has no weight-only e4m3 kernel)")
    if dtype != torch.bfloat16:
        dense = "float weights: BLAS (F.linear)"
    elif isa == "amx":  # kernels/cpu/quant_linear.cpp: bf16_amx
        dense = ("bf16 weights too, on AMX tiles (inputs a multiple of 32; else the "
                 "AVX-512 tile, and oneDNN from 128 rows)")
    else:
        dense = "bf16 weights too (oneDNN from 128 rows)"
    vector = "avx512" if isa == "amx" else isa
    return (f"int8, int4, fp8 and GGUF blocks: C++ kernels, {vector} path "
            f"(kernels/cpu/quant_linear.cpp); {dense}; packed once after loading "
            f"(optimized/quant_layers.py)")
