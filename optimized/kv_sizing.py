"""The KV pool sized as vLLM sizes it on a GPU: what the memory budget leaves once the weights
and the activations of the largest possible step are in.

One profiling forward at the full token budget measures the activations' peak; the pool gets
gpu_memory_utilization x the GPU's memory, minus what is in use (weights, CUDA context, anything
else on the GPU) and that peak. The optimized model runner calls this when neither
num_gpu_blocks nor kv_cache_memory was given, on CUDA only (``profile_num_blocks``).
"""

import torch

from pagedllm.reference.kv import CacheEngine, KVCacheConfig
from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.model.quantization import weight_bytes


# --8<-- [start:profile_num_blocks]
def profile_num_blocks(model, backend, kv_cache_groups, max_tokens: int,
                       max_model_len: int, utilization: float) -> int:
    """KV blocks that fit once the weights and a full step's activations are in memory.

    One forward of max_tokens tokens (the most a step can compute, as sequences of at
    most max_model_len tokens: positions stay inside the model's table) over a pool just
    large enough for them, laid out as the runner's kv_cache_groups say (its
    ``get_kv_cache_spec``: per-head K/V, or a latent row); the peak it reaches is what
    every step may need.
    """
    device = next(model.parameters()).device
    block_size = kv_cache_groups[0].kv_cache_spec.block_size
    lens = [max_model_len] * (max_tokens // max_model_len)
    if max_tokens % max_model_len:
        lens.append(max_tokens % max_model_len)
    per_seq = -(-max(lens) // block_size)
    blocks = per_seq * len(lens)
    pool = KVCacheConfig(blocks, 0, kv_cache_groups)
    cache = CacheEngine.from_kv_cache_config(pool, device, backend)
    seq_lens = torch.tensor(lens, dtype=torch.int32)  # [S]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                          dtype=torch.int32)  # [S + 1]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)  # [max_tokens]
    # [S, per_seq]
    tables = torch.arange(blocks, dtype=torch.int32).view(len(lens), per_seq)
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
        attn = PagedAttention(md, cache.layer_k, cache.layer_v, backend, cache.quant)
        model(ids, positions, attn, logits_indices=starts[1:].to(device) - 1)
    torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before  # the step's peak
    weights = weight_bytes(model)  # quantized codes and scales included
    del attn, cache
    torch.cuda.empty_cache()
    # In use now: the weights, the CUDA context, whatever else runs on the GPU.
    free, total = torch.cuda.mem_get_info(device)
    free_for_kv = utilization * total - (total - free) - activations
    num_blocks = int(free_for_kv // pool.bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"gpu_memory_utilization = {utilization} leaves no room for the KV cache "
            f"after {weights / 2**30:.2f} GiB of weights and "
            f"{activations / 2**30:.2f} GiB of activations; raise it or lower "
            "max_num_batched_tokens")
    return num_blocks
# --8<-- [end:profile_num_blocks]
