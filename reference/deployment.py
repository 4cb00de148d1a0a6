"""Will the model fit, and how many users then? Weights and KV cache per GPU.

A GPU's memory holds the model's weights first; what the memory fraction the engine may use
(vLLM's ``--gpu-memory-utilization``, 0.9 by default) leaves after them is the KV cache. So the
first lever when a model does not fit is the weights' precision (seeds 003 and 004), the second
is splitting the model across GPUs (tensor parallelism, ``--tensor-parallel-size``): each GPU
then holds 1/N of every weight matrix and 1/N of the KV heads.

    weights per GPU  = (linear parameters x bytes per weight  +  embeddings in the dtype) / N
    KV per GPU       = memory x utilization - weights per GPU
    bytes per token  = 2 x layers x (KV heads / N) x head_dim x bytes per element    (per GPU)

Bytes per linear weight, scales included (``ops/weight_quant.py`` stores them so):
bf16/fp16 2; fp8 1 (one scale per tensor); int8 1 + one 16-bit scale per output channel;
int4 0.5 + a 16-bit scale and zero point per group (0.625 for groups of 32, 0.531 for 128).
Embeddings and norms stay in the dtype; a separate (untied) LM head is a linear layer and is
quantized with the rest. fp8 weights are planned here (seed 003's ``--quantization fp8``) but
not run by pagedllm, which runs int8, int4 and GGUF blocks (lesson 18).

With more GPUs than KV heads, each GPU keeps one head and the heads are replicated (vLLM's
``num_kv_head_replicas``): the KV per token per GPU stops shrinking. Activations, CUDA graphs
and the allocator's own overhead are not counted: vLLM measures them with a profiling run and
they typically take a few GiB, so read the answers as upper bounds.

    python -m pagedllm.reference.kv_size llama-2-7b --quantization int4 --gpu-memory-gib 24
    python -m pagedllm.reference.kv_size llama-3.1-405b --gpu-memory-gib 80 \\
        --tensor-parallel-size 8 --quantization fp8 --context 16384
"""

import math
from dataclasses import dataclass

from .kv_size import GIB, KVSize
from .ops.weight_quant import INT4_GROUP_SIZES

# What a weight can be stored as for planning: the checkpoint's dtype (None), or a scheme.
PLAN_QUANTIZATIONS = (None, "fp8", "int8", "int4")

# Published parameter counts (model cards / config.json), the embedding table's size
# (vocab x hidden) and whether the LM head shares it. Everything else is in linear layers.
WEIGHT_PRESETS = {  # name: (parameters, vocab, hidden, tied head)
    "opt-6.7b": (6.66e9, 50272, 4096, True),
    "opt-13b": (12.85e9, 50272, 5120, True),
    "opt-66b": (65.7e9, 50272, 9216, True),
    "opt-175b": (174.6e9, 50272, 12288, True),
    "llama-2-7b": (6.74e9, 32000, 4096, False),
    "llama-2-13b": (13.02e9, 32000, 5120, False),
    "llama-2-70b": (68.98e9, 32000, 8192, False),
    "llama-3-8b": (8.03e9, 128256, 4096, False),
    "llama-3.1-8b": (8.03e9, 128256, 4096, False),
    "llama-3-70b": (70.55e9, 128256, 8192, False),
    "llama-3.1-405b": (405.85e9, 128256, 16384, False),
    "mistral-7b": (7.24e9, 32000, 4096, False),
    "qwen2.5-0.5b": (0.494e9, 151936, 896, True),
    "qwen2.5-7b": (7.62e9, 152064, 3584, False),
    "qwen3-0.6b": (0.596e9, 151936, 1024, True),
    "qwen3-8b": (8.19e9, 151936, 4096, False),
    "smollm2-135m-instruct": (134.5e6, 49152, 576, True),
}


# --8<-- [start:bytes_per_weight]
def bytes_per_weight(quantization: str | None, dtype_bytes: int, group_size: int = 32,
                     in_features: int = 4096) -> float:
    """Bytes one linear-layer weight costs, its share of the scales and zero points included."""
    if quantization is None:
        return dtype_bytes
    if quantization == "fp8":
        return 1.0  # one scale per tensor: nothing per weight
    if quantization == "int8":
        return 1 + dtype_bytes / in_features  # a scale per output row of in_features weights
    if quantization == "int4":
        return 0.5 + 2 * dtype_bytes / group_size  # a scale and a zero point per group
    raise ValueError(f"quantization {quantization!r} is unknown for planning; choose one of "
                     f"{PLAN_QUANTIZATIONS}")
# --8<-- [end:bytes_per_weight]


@dataclass(frozen=True)
class Deployment:
    """One model on tensor_parallel_size GPUs of gpu_memory_gib each."""

    kv: KVSize  # the model's KV shape, dtype and cache dtype
    parameters: float
    embedding_parameters: int  # vocab x hidden: stays in the dtype
    quantization: str | None
    group_size: int
    hidden: int
    tensor_parallel_size: int
    gpu_memory_gib: float
    gpu_memory_utilization: float

    @property
    def weight_bytes(self) -> float:
        """All weights, all GPUs together."""
        linear = self.parameters - self.embedding_parameters
        per_weight = bytes_per_weight(self.quantization, self.kv.dtype_bytes, self.group_size,
                                      self.hidden)
        return linear * per_weight + self.embedding_parameters * self.kv.dtype_bytes

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tensor_parallel_size

    # --8<-- [start:per_gpu]
    @property
    def kv_heads_per_gpu(self) -> int:
        # Fewer KV heads than GPUs: one head per GPU, replicated (num_kv_head_replicas).
        return max(1, self.kv.num_kv_heads // self.tensor_parallel_size)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        return 2 * self.kv.num_layers * self.kv_heads_per_gpu * self.kv.bytes_per_token_head

    @property
    def kv_bytes_per_gpu(self) -> float:
        """What the usable memory leaves for the KV cache after the weights (negative: the
        weights alone do not fit)."""
        usable = self.gpu_memory_gib * GIB * self.gpu_memory_utilization
        return usable - self.weight_bytes_per_gpu

    @property
    def tokens(self) -> int:
        """KV token slots: every GPU holds its heads of the same tokens."""
        return max(0, int(self.kv_bytes_per_gpu // self.kv_bytes_per_token_per_gpu))
    # --8<-- [end:per_gpu]

    def sequences(self, context: int) -> int:
        """Sequences that can each reach `context` tokens at once."""
        return self.tokens // context


def deployment(kv: KVSize, gpu_memory_gib: float, tensor_parallel_size: int = 1,
               quantization: str | None = None, group_size: int = 32,
               gpu_memory_utilization: float = 0.9) -> Deployment:
    """The plan for a preset of WEIGHT_PRESETS (ValueError naming what is wrong)."""
    if kv.name not in WEIGHT_PRESETS:
        raise ValueError(f"no parameter count for {kv.name!r}; planning weights needs a preset: "
                         f"{', '.join(WEIGHT_PRESETS)}")
    if quantization not in PLAN_QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is unknown for planning; choose one of "
                         f"{PLAN_QUANTIZATIONS}")
    if quantization == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got "
                         f"{group_size!r}")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got "
                         f"{tensor_parallel_size!r}")
    heads, n = kv.num_kv_heads, tensor_parallel_size
    if heads % n and n % heads:
        raise ValueError(f"tensor_parallel_size {n} neither divides {kv.name}'s {heads} KV heads "
                         f"nor is a multiple of them; choose a divisor or a multiple of {heads}")
    if not (isinstance(gpu_memory_gib, int | float) and math.isfinite(gpu_memory_gib)
            and gpu_memory_gib > 0):
        raise ValueError(f"gpu_memory_gib must be a positive number of GiB, got "
                         f"{gpu_memory_gib!r}")
    if not (isinstance(gpu_memory_utilization, int | float)
            and 0 < gpu_memory_utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization!r}")
    parameters, vocab, hidden, _tied = WEIGHT_PRESETS[kv.name]
    return Deployment(kv, parameters, vocab * hidden, quantization, group_size, hidden, n,
                      gpu_memory_gib, gpu_memory_utilization)


def describe_deployment(d: Deployment, context: int) -> str:
    scheme = d.quantization or f"{d.kv.dtype_bytes * 8}-bit float"
    if d.quantization == "int4":
        scheme += f", groups of {d.group_size}"
    usable = d.gpu_memory_gib * d.gpu_memory_utilization
    lines = [
        f"  weights ({scheme}): {d.weight_bytes / 1e9:,.1f} GB in all, "
        f"{d.weight_bytes_per_gpu / GIB:,.1f} GiB per GPU on {d.tensor_parallel_size}",
        f"  usable per GPU: {d.gpu_memory_gib:g} GiB x {d.gpu_memory_utilization:g} = "
        f"{usable:,.1f} GiB",
    ]
    if d.kv_bytes_per_gpu <= 0:
        short = -d.kv_bytes_per_gpu / GIB
        lines.append(f"  does not fit: the weights need {short:,.1f} GiB more per GPU than "
                     f"the usable memory; quantize them or add GPUs")
        return "\n".join(lines)
    replicated = (" (replicated: more GPUs than KV heads)"
                  if d.tensor_parallel_size > d.kv.num_kv_heads else "")
    lines += [
        f"  KV cache per GPU: {d.kv_bytes_per_gpu / GIB:,.1f} GiB; "
        f"{d.kv_heads_per_gpu} of {d.kv.num_kv_heads} KV heads per GPU{replicated}, "
        f"{d.kv_bytes_per_token_per_gpu:,} bytes per token per GPU",
        f"  tokens that fit: {d.tokens:,}; sequences at {context:,} tokens each: "
        f"{d.sequences(context):,}",
    ]
    return "\n".join(lines)
