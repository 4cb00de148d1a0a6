"""``pagedllm env``: this machine as the engine sees it, and what computes each op on it.

A learner asking "what computes rms_norm on my laptop?" gets one answer here: the CPU and its
instruction sets, the path the C++ kernels take (AVX-512, AVX2 or portable C++) or why none
builds, what ``dtype="auto"`` picks on this CPU, and each backend's ops with the reason, for a
float32 and a bf16 model (a GPU's Triton backend too, where torch sees one).
"""

import argparse
import platform

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"),
                        help="the model dtype(s) to report for (default: both)")


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux), else the platform's word."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The SIMD flags the kernels' paths care about, as Linux lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in SIMD_FLAGS if flag in have]
    except OSError:
        pass
    return []


def run(args) -> int:
    from pagedllm.kernels import cpu_ops
    from pagedllm.optimized.backend import TRITON_BACKEND, describe, select_backend
    from pagedllm.reference.engine.config import auto_quantized_dtype

    print(f"CPU: {cpu_model()} ({platform.machine()}), {torch.get_num_threads()} torch "
          f"threads; torch {torch.__version__}")
    print(f"SIMD: {' '.join(cpu_flags()) or 'unknown'} (the kernels use AVX-512 BF16/VNNI or "
          f"AVX2+FMA; AMX tiles for bf16 products, where Linux grants them)")
    print(f"CPU kernels: {cpu_ops.cpu_kernels_status()}")
    print(f"bf16 computed natively on this CPU: {cpu_ops.native_bf16()} — dtype='auto' with a "
          f"quantized model computes in {auto_quantized_dtype(torch.device('cpu'))}")
    # what a model on the CPU gets here: CPU_BACKEND, or the interpreted Triton kernels
    # under TRITON_INTERPRET=1
    backends = [("cpu", select_backend(torch.device("cpu")))]
    if torch.cuda.is_available():
        backends.append((f"cuda ({torch.cuda.get_device_name()})", TRITON_BACKEND))
    for dtype_name in args.dtype or ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        for device, backend in backends:
            print(f"\n{device}, a {dtype_name} model — backend {backend.name!r}:")
            for op, how in describe(backend, dtype).items():
                print(f"  {op:<24} {how}")
    return 0
