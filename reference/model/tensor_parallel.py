"""Tensor parallelism: one model split across N ranks, each holding 1/N of every layer.

Megatron-LM's split (Shoeybi et al., 2019), as vLLM and nano-vllm do it. A transformer layer is
two matrix products in a row twice over: Q/K/V then o_proj, gate/up then down_proj. Split the
first product of each pair by output columns ("column-parallel": rank r computes its own heads,
or its slice of the MLP's hidden units, from the whole input) and the second by input rows
("row-parallel": rank r multiplies its slice of the activations by its rows of the weight). The
column split needs no communication, because attention is independent per head and SiLU-and-mul
per unit; the row split leaves each rank a partial sum of the layer's output, and one all-reduce
adds them. Two all-reduces per layer, each of T x hidden values: the whole cost of the split.

    x [T, hidden] --q/k/v (columns: my heads)--> attention over my heads --o_proj (my rows)-->
        partial [T, hidden] --all-reduce (sum over ranks)--> [T, hidden]

The KV cache follows the heads: rank r stores the K/V of its KV heads only, so each rank's pool
holds 1/N of every token and the tokens that fit grow with N. Heads split by whole KV groups
(a KV head and the query heads that read it stay on one rank); when there are more ranks than
KV heads, each KV head is replicated on N / kv_heads ranks, which split its query heads (vLLM's
``num_kv_head_replicas``). The vocabulary splits too: the embedding looks up only the ids in
its rank's range (zeros elsewhere) and an all-reduce assembles the rows; the LM head computes its
rank's slice of the logits, which are gathered where sampling happens (rank 0).

Splits may be uneven (SmolLM2's 3 KV heads over 2 ranks: 2 and 1): every split below is into
contiguous ranges whose sizes differ by at most one.

Loading reads only each rank's shard: the model is built on the meta device, narrowed to the
rank's shapes (``narrow_model``, which says which slice of each saved tensor the rank takes),
and the loader reads just those slices from the safetensors files. ``parallelize`` then wraps
the row-parallel layers, the embedding and the LM head with their communication.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .config import ModelConfig, load_config
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .loader import ARCHITECTURES, parse_device, parse_dtype
from .opt import OPTForCausalLM
from .weights import weight_files


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous part of `size` items; sizes differ by at most one."""
    return size * rank // world_size, size * (rank + 1) // world_size


# --8<-- [start:heads]
def check_tensor_parallel_size(cfg: ModelConfig, world_size: int) -> None:
    """ValueError unless this model's heads split over world_size ranks: by KV heads
    when world_size <= kv_heads, else by replicating each KV head over
    world_size / kv_heads ranks (which must be a whole number, and at most the query
    heads per KV head)."""
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    if world_size <= kv:
        return
    if world_size % kv or world_size > heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} does not split this model's attention "
            f"({heads} query heads, {kv} KV heads): use at most {kv} ranks (each takes "
            f"whole KV heads), or a multiple of {kv} up to {heads} (each KV head "
            "replicated, its query heads split)")


def attention_heads(cfg: ModelConfig, rank: int,
                    world_size: int) -> tuple[range, range]:
    """The query heads and the KV heads rank r computes."""
    group = cfg.num_heads // cfg.num_kv_heads  # query heads reading one KV head
    if world_size <= cfg.num_kv_heads:  # whole KV groups per rank
        kv0, kv1 = shard_range(cfg.num_kv_heads, rank, world_size)
        return range(kv0 * group, kv1 * group), range(kv0, kv1)
    replicas = world_size // cfg.num_kv_heads  # ranks holding a copy of each KV head
    kv = rank // replicas
    q0, q1 = shard_range(group, rank % replicas, replicas)
    return range(kv * group + q0, kv * group + q1), range(kv, kv + 1)
# --8<-- [end:heads]


# -- narrowing a (meta) model to one rank's shapes ---------------------------------------------
Slices = dict[str, tuple[int, int, int]]  # tensor name -> (dim, start, end) of the saved tensor


def _narrow(module: nn.Module, dim: int, start: int, end: int, prefix: str, slices: Slices,
            bias: str = "narrow") -> None:
    """Keep rows (dim 0) or columns (dim 1) [start, end) of a linear layer's weight. A
    row-parallel layer's bias is added once, on rank 0, before the all-reduce: bias="drop"."""
    module.weight = nn.Parameter(module.weight.narrow(dim, start, end - start),
                                 requires_grad=False)
    slices[f"{prefix}.weight"] = (dim, start, end)
    if dim == 0:
        module.out_features = end - start
    else:
        module.in_features = end - start
    if getattr(module, "bias", None) is not None:
        if bias == "drop":
            module.bias = None
        elif dim == 0:
            module.bias = nn.Parameter(module.bias[start:end], requires_grad=False)
            slices[f"{prefix}.bias"] = (0, start, end)


def narrow_model(model: nn.Module, rank: int, world_size: int) -> Slices:
    """Narrow a model of the Llama family, OPT or Gemma 3 (on the meta device) to rank's shard,
    in place, and say which slice of each saved tensor it keeps (tensors not named: kept
    whole)."""
    cfg: ModelConfig = model.config
    check_tensor_parallel_size(cfg, world_size)
    q_heads, kv_heads = attention_heads(cfg, rank, world_size)
    hd, slices = cfg.head_dim, {}
    q = (q_heads.start * hd, q_heads.stop * hd)  # the rank's rows of q_proj
    kv = (kv_heads.start * hd, kv_heads.stop * hd)  # ... of k_proj and v_proj
    mlp = shard_range(cfg.intermediate_size, rank, world_size)
    row_bias = "narrow" if rank == 0 else "drop"  # kept whole on rank 0 (dim 1 never narrows)
    # Gemma 3's layers have Llama's names; its per-head q/k norms are replicated on every rank
    # (their weight is one head's), and its embedding scale is applied after the lookup.
    if isinstance(model, LlamaForCausalLM | Gemma3ForCausalLM):
        stack, prefix = model.model, "model"
        names = ("self_attn", "o_proj", "mlp", ("gate_proj", "up_proj"), "down_proj")
    elif isinstance(model, OPTForCausalLM):
        stack, prefix = model.model.decoder, "model.decoder"
        names = ("self_attn", "out_proj", "", ("fc1",), "fc2")
    else:
        raise ValueError(f"tensor parallelism splits the Llama family, OPT and Gemma 3, not "
                         f"{type(model).__name__}")
    attn_name, out_name, mlp_name, up_names, down_name = names
    for i, layer in enumerate(stack.layers):
        p = f"{prefix}.layers.{i}"
        attn = getattr(layer, attn_name)
        _narrow(attn.q_proj, 0, *q, f"{p}.{attn_name}.q_proj", slices)
        _narrow(attn.k_proj, 0, *kv, f"{p}.{attn_name}.k_proj", slices)
        _narrow(attn.v_proj, 0, *kv, f"{p}.{attn_name}.v_proj", slices)
        _narrow(getattr(attn, out_name), 1, *q, f"{p}.{attn_name}.{out_name}", slices, row_bias)
        attn.num_heads = len(q_heads)
        if hasattr(attn, "num_kv_heads"):
            attn.num_kv_heads = len(kv_heads)
        ffn = getattr(layer, mlp_name) if mlp_name else layer
        ffn_prefix = f"{p}.{mlp_name}" if mlp_name else p
        for name in up_names:
            _narrow(getattr(ffn, name), 0, *mlp, f"{ffn_prefix}.{name}", slices)
        _narrow(getattr(ffn, down_name), 1, *mlp, f"{ffn_prefix}.{down_name}", slices, row_bias)
    vocab = shard_range(cfg.vocab_size, rank, world_size)
    embed = stack.embed_tokens
    embed.weight = nn.Parameter(embed.weight[vocab[0]:vocab[1]], requires_grad=False)
    embed.num_embeddings = vocab[1] - vocab[0]
    slices[f"{prefix}.embed_tokens.weight"] = (0, *vocab)
    _narrow(model.lm_head, 0, *vocab, "lm_head", slices)
    return slices


# -- the layers that communicate -----------------------------------------------------------------
def all_reduce_max(x: torch.Tensor) -> None:
    """x becomes its largest value over every rank, in place."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX)


# --8<-- [start:row_parallel]
class RowParallelLinear(nn.Module):
    """A linear layer holding the rank's input columns: each rank's product is a partial
    sum of the output, and one all-reduce adds them (the bias, on rank 0 only, is added
    once)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear  # any linear layer: float, quantized, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)  # [T, out]: this rank's share of the sum
        dist.all_reduce(partial)  # [T, out]: the whole product, on every rank
        return partial
# --8<-- [end:row_parallel]


# --8<-- [start:vocab_parallel]
class VocabParallelEmbedding(nn.Module):
    """The rows [start, end) of the embedding table: ids outside them look up zeros
    here and their row on another rank; an all-reduce adds the N lookups into the full
    rows."""

    def __init__(self, embedding: nn.Embedding, start: int):
        super().__init__()
        self.weight = embedding.weight  # [end - start, dim]
        self.start, self.end = start, start + embedding.weight.shape[0]

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mine = (token_ids >= self.start) & (token_ids < self.end)  # [T]
        local = torch.where(mine, token_ids - self.start, 0)
        x = F.embedding(local, self.weight)  # [T, dim]
        x = x.masked_fill(~mine.unsqueeze(-1), 0)  # zeros for the ids of other ranks
        dist.all_reduce(x)  # exactly one rank holds each row: the sum is that row
        return x


class VocabParallelLMHead(nn.Module):
    """The LM head's rows [start, end) of the vocabulary: each rank computes its slice
    of the logits and rank 0, where sampling happens, gathers them (the others return
    None)."""

    def __init__(self, linear: nn.Module, vocab_size: int, rank: int, world_size: int):
        super().__init__()
        self.linear = linear
        self.rank, self.world_size = rank, world_size
        self.sizes = [b - a for a, b in (shard_range(vocab_size, r, world_size)
                                         for r in range(world_size))]

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        local = self.linear(x)  # [S, my share of the vocabulary]
        width = max(self.sizes)  # gather takes equal shapes: pad the narrower shards
        local = F.pad(local, (0, width - local.shape[-1])).contiguous()
        parts = None
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in self.sizes]
        dist.gather(local, parts, dst=0)
        if parts is None:
            return None
        return torch.cat([p[:, :n] for p, n in zip(parts, self.sizes, strict=True)],
                         dim=-1)  # [S, vocab]
# --8<-- [end:vocab_parallel]


def parallelize(model: nn.Module, rank: int, world_size: int) -> nn.Module:
    """Wrap a narrowed, loaded model's communicating layers, in place."""
    is_opt = isinstance(model, OPTForCausalLM)
    stack = model.model.decoder if is_opt else model.model
    for layer in stack.layers:
        if is_opt:
            layer.self_attn.out_proj = RowParallelLinear(layer.self_attn.out_proj)
            layer.fc2 = RowParallelLinear(layer.fc2)
        else:
            layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj)
            layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj)
    start = shard_range(model.config.vocab_size, rank, world_size)[0]
    stack.embed_tokens = VocabParallelEmbedding(stack.embed_tokens, start)
    model.lm_head = VocabParallelLMHead(model.lm_head, model.config.vocab_size, rank, world_size)
    return model


def row_parallel_absmax(model: nn.Module, model_dir, dtype: torch.dtype) -> dict:
    """{inner layer name: [out]} each row-parallel layer's whole rows' max |w|, read from
    the checkpoint: a shard holds only its slice of every row, and int8's one scale per row
    must be the whole row's, as on one rank, for the shards' codes to be slices of one
    quantization (then N ranks run N = 1's quantized weights, split)."""
    wanted = {name + ".weight": name + ".linear" for name, m in model.named_modules()
              if isinstance(m, RowParallelLinear)}
    absmax = {}
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for key in wanted.keys() & set(f.keys()):
                # the model's dtype first: the values one rank would quantize
                absmax[wanted[key]] = f.get_tensor(key).to(dtype).float().abs().amax(dim=1)
    return absmax


# --8<-- [start:load_shard]
def load_model_shard(model_dir, rank: int, world_size: int,
                     dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> nn.Module:
    """Rank's shard of a checkpoint folder, reading only its slices of each saved
    tensor, with its communicating layers wrapped (``parallelize``)."""
    cfg, device = load_config(model_dir), parse_device(device)
    dtype = parse_dtype(dtype) or cfg.dtype
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.model_type](cfg)
    slices = narrow_model(model, rank, world_size)
    expected = model.state_dict()  # names and shapes of this rank's shard
    state = {}
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name not in expected:
                    continue  # rank 0's row-parallel bias, or a name the model lacks
                saved = f.get_slice(name)
                dim, start, end = slices.get(name, (0, None, None))
                tensor = saved[start:end] if dim == 0 else saved[:, start:end]
                state[name] = tensor.to(device=device, dtype=dtype)
    embed = ("model.decoder.embed_tokens.weight" if cfg.is_opt
             else "model.embed_tokens.weight")
    if "lm_head.weight" not in state and cfg.tie_word_embeddings:
        state["lm_head.weight"] = state[embed]  # tied: the same slice of the same table
    wrong = sorted(set(expected) ^ set(state)) + [
        n for n in state if n in expected and state[n].shape != expected[n].shape]
    if wrong:
        raise ValueError(f"the checkpoint in {model_dir} does not match the "
                         f"{cfg.model_type} model its config describes (first: "
                         f"{wrong[0]!r}); config.json and the weights must come from "
                         "the same save_pretrained")
    model.load_state_dict(state, assign=True)
    return parallelize(model.eval(), rank, world_size)
# --8<-- [end:load_shard]
