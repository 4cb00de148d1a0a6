"""The optimized engine: the reference's LLMEngine with its own model execution.

Scheduling, the KV cache manager, sequence groups, step-input preparation, sampling parameters,
stop checks, beam search and outputs are the reference's, inherited as they are. What changes:

- the model's attention and MLP projections are merged (``layers.py``);
- the ops are the optimized backend's (``backend.py``): Triton kernels on CUDA, the kernels
  under the interpreter on the CPU with TRITON_INTERPRET=1, a vectorized torch path otherwise;
- the forward runs from persistent buffers, with CUDA graphs for decode steps
  (``model_runner.py``);
- on CUDA the KV pool is sized as vLLM sizes it: a profiling forward at the full token budget
  measures the activations' peak, and the pool gets gpu_memory_utilization x the GPU's memory
  minus the weights and that peak.

The static-batching and contiguous-slab baselines exist to be measured against, in the
reference tier; this engine runs the paged layout with continuous batching only.
"""

import torch

from pagedllm.reference.engine.engine import LLMEngine as ReferenceEngine
from pagedllm.reference.engine.engine import check_backend
from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.engine.validation import check_float
from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.ops import REFERENCE_BACKEND

from .backend import OPTIMIZED_BACKEND
from .layers import merge_projections
from .model_runner import ModelRunner


class LLMEngine(ReferenceEngine):
    def __init__(self, model, tokenizer=None, *, kv_layout: str = "paged",
                 scheduler_config, block_size: int = 16, num_gpu_blocks: int,
                 backend=OPTIMIZED_BACKEND, enforce_eager: bool = False,
                 gpu_memory_utilization: float | None = None, **kwargs):
        if kv_layout == "contiguous":
            raise ValueError(f"kv_layout {kv_layout!r}: the optimized tier runs the paged layout "
                             "only; the contiguous baseline is the reference tier's "
                             "(pagedllm.reference.LLM)")
        if scheduler_config.batching == "static":
            raise ValueError(f"batching {scheduler_config.batching!r}: the optimized tier runs "
                             "continuous batching only; the static baseline is the reference "
                             "tier's (pagedllm.reference.LLM)")
        if not isinstance(enforce_eager, bool):
            raise TypeError(f"enforce_eager must be True or False, got {enforce_eager!r}")
        if backend is REFERENCE_BACKEND:  # the reference LLM's default: not this tier's ops
            backend = OPTIMIZED_BACKEND
        check_backend(backend)  # before the profiling forward uses it
        model = merge_projections(model)
        device = next(model.parameters()).device
        if gpu_memory_utilization is not None:  # checked on every device, used on CUDA
            check_float("gpu_memory_utilization", gpu_memory_utilization, low=0.0, high=1.0,
                        low_open=True)
        if gpu_memory_utilization is not None and device.type == "cuda":
            num_gpu_blocks = profile_num_blocks(model, backend, block_size,
                                                scheduler_config.max_num_batched_tokens,
                                                scheduler_config.max_model_len,
                                                gpu_memory_utilization)
        super().__init__(model, tokenizer, kv_layout=kv_layout, block_size=block_size,
                         num_gpu_blocks=num_gpu_blocks, scheduler_config=scheduler_config,
                         backend=backend, **kwargs)
        sc = scheduler_config
        self.runner = ModelRunner(
            model, self.cache_engine.gpu_k, self.cache_engine.gpu_v, backend,
            max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len, block_size=block_size, enforce_eager=enforce_eager)

    # --8<-- [start:execute_model]
    def execute_model(self, inputs: StepInputs) -> torch.Tensor:
        return self.runner.execute(inputs)  # [S, vocab]
    # --8<-- [end:execute_model]


# --8<-- [start:profile_num_blocks]
def profile_num_blocks(model, backend, block_size: int, max_tokens: int, max_model_len: int,
                       utilization: float) -> int:
    """KV blocks that fit once the weights and a full step's activations are in memory.

    One forward of max_tokens tokens (the most a step can compute, as sequences of at most
    max_model_len tokens: positions stay inside the model's table) over a pool just large enough
    for them; the peak it reaches is what every step may need.
    """
    cfg, device = model.config, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    lens = [max_model_len] * (max_tokens // max_model_len)
    if max_tokens % max_model_len:
        lens.append(max_tokens % max_model_len)
    per_seq = -(-max(lens) // block_size)
    blocks = per_seq * len(lens)
    shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    seq_lens = torch.tensor(lens, dtype=torch.int32)  # [S]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)  # [max_tokens]
    tables = torch.arange(blocks, dtype=torch.int32).view(len(lens), per_seq)  # [S, per_seq]
    slots = torch.cat([tables[i].long().repeat_interleave(block_size)[:n] * block_size
                       + torch.arange(n) % block_size for i, n in enumerate(lens)])
    md = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=seq_lens.to(device), query_start_loc=starts.to(device),
        seq_lens_cpu=seq_lens, query_start_loc_cpu=starts)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        model(ids, positions, PagedAttention(md, k, v, backend),
              logits_indices=starts[1:].to(device) - 1)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before  # the step's peak
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del k, v
    torch.cuda.empty_cache()
    # In use now: the weights, the CUDA context, whatever else runs on the GPU.
    free, total = torch.cuda.mem_get_info(device)
    free_for_kv = utilization * total - (total - free) - activations
    per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    num_blocks = int(free_for_kv // per_block)
    if num_blocks < 1:
        raise ValueError(f"gpu_memory_utilization = {utilization} leaves no room for the KV cache "
                         f"after {weights / 2**30:.2f} GiB of weights and {activations / 2**30:.2f}"
                         " GiB of activations; raise it or lower max_num_batched_tokens")
    return num_blocks
# --8<-- [end:profile_num_blocks]
