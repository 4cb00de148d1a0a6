"""The model runner: a step's inputs in persistent buffers, the forward, CUDA graphs for decodes.

The reference builds every step's tensors afresh and hands them to the model. Here the step's
metadata is copied into buffers allocated once, at the largest size the scheduler allows
(max_num_batched_tokens rows, max_num_seqs sequences, max_model_len / block_size blocks each),
and the model reads views of them. Nothing about the step's content changes: the inputs are the
reference's ``prepare_inputs`` output, copied.

What else this runner owns: the merged projections (``layers.py``, done when it is built), the
KV pool's size on CUDA (``kv_sizing.py``), and which attention runs — decided once, here, from
the device: the kernel with device-side metadata on CUDA, the kernels under the interpreter on
a CPU with ``TRITON_INTERPRET=1``, and otherwise the vectorized CPU path planned once per step
(``attention.py``). A backend whose attention op was swapped (a wrapper, a failing op in a
test) is called as it is, with the reference's arguments.

Fixed addresses are what CUDA graphs need. A decode step launches a few kernels per layer, each
doing microseconds of work after a few microseconds of CPU-side launch cost; on a small model the
GPU waits for the CPU. A CUDA graph records the whole forward once per batch size and replays it
with one launch. A decode batch of B sequences is padded to the next captured size: the padding
rows write their K/V nowhere (slot -1), attend over one slot of block 0, and are never sampled.
"""

from dataclasses import replace

import torch

from pagedllm.kernels.paged_attention import paged_attention as triton_paged_attention
from pagedllm.kernels.rms_norm import rms_norm as triton_rms_norm
from pagedllm.kernels.runtime import interpreting
from pagedllm.kernels.store_kv import store_kv as triton_store_kv
from pagedllm.reference.engine.model_runner import ModelRunner as ReferenceModelRunner
from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.model import AttentionMetadata, PagedAttention

from .attention import PlannedAttention
from pagedllm.kernels.cpu_ops import cpu_kernels
from pagedllm.kernels.cpu_ops import rms_norm as cpu_rms_norm
from pagedllm.kernels.cpu_ops import store_kv as cpu_store_kv
from .decode_step import DecodeStep
from .kv_sizing import profile_num_blocks
from .layers import merge_projections, transpose_linears
from .quant_layers import pack_linears_for_cpu, triton_quantized_linears

# Decode batch sizes captured as CUDA graphs (vLLM captures 1, 2, 4 and multiples of 8).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DeviceAttention(PagedAttention):
    """The engine's attention context, handing the kernels device-side lengths and offsets.

    The reference passes host copies (its loop needs Python ints). On CUDA the kernel needs only
    device tensors and finds its bounds from shapes, so passing them avoids a host-to-device
    copy per layer and lets the forward be captured in a CUDA graph.
    """

    def read(self, layer, q, scale, sliding_window=None):
        md = self.metadata
        return self.backend.paged_attention(
            q, self.k_caches[layer], self.v_caches[layer], md.block_tables, md.seq_lens,
            md.query_start_loc, scale, sliding_window, *self.quant.args(layer))


class ModelRunner(ReferenceModelRunner):
    tier = "optimized"
    runs_baselines = False  # paged layout and continuous batching only
    profiles_kv_cache = True
    captures_graphs = True

    def __init__(self, model, config, rank: int = 0):
        model = merge_projections(model)
        on_cpu = next(model.parameters()).device.type == "cpu"
        if on_cpu and config.dtype == torch.float32:
            # BLAS's faster layout for few-row fp32 products; bf16/fp16 products are faster
            # in nn.Linear's own [out, in] layout (oneDNN's kernels; linear_layout.py).
            model = transpose_linears(model)
        if on_cpu and not interpreting():
            model = pack_linears_for_cpu(model, config.dtype)  # our kernel or torch's
        else:  # CUDA, or the kernels under the interpreter
            model = triton_quantized_linears(model)
        super().__init__(model, config, rank)
        if on_cpu and not interpreting() and config.dtype == torch.bfloat16 and cpu_kernels():
            # The tier's own ops (not ones swapped in), which without Triton would run
            # their twins, as one pass each: the norm's ten operators, the K/V write's
            # check and two indexed copies.
            if self.backend.rms_norm is triton_rms_norm:
                self.backend = replace(self.backend, rms_norm=cpu_rms_norm)
            if self.backend.store_kv is triton_store_kv:
                self.backend = replace(self.backend, store_kv=cpu_store_kv)
        # A decode step's layers in one C++ call where it can (decode_step.py): the CPU's
        # counterpart of the CUDA graphs below, and like them off with enforce_eager.
        self.decode_step = DecodeStep.build(self.model, self.backend, config.dtype) \
            if on_cpu and not interpreting() and not config.enforce_eager \
            and config.tensor_parallel_size == 1 else None
        sc = config.scheduler_config
        self.device = next(self.model.parameters()).device
        self.max_blocks = -(-sc.max_model_len // config.block_size)
        tokens = max(sc.max_num_batched_tokens, sc.max_num_seqs)

        # --8<-- [start:buffers]
        def buffer(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.input_ids, self.positions = buffer(tokens), buffer(tokens)  # [T_max]
        self.slot_mapping = buffer(tokens)  # [T_max]
        self.block_tables = buffer(sc.max_num_seqs, self.max_blocks, dtype=torch.int32)
        self.seq_lens = buffer(sc.max_num_seqs, dtype=torch.int32)  # [B_max]
        self.query_start_loc = buffer(sc.max_num_seqs + 1, dtype=torch.int32)  # [B_max + 1]
        # --8<-- [end:buffers]
        self.attention = self._attention_context()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Graphs capture the kernel's launches; a swapped-in op may sync with the host, and a
        # tensor-parallel forward's all-reduces are not captured (gloo cannot be; NCCL untried).
        self.use_graphs = (self.attention is DeviceAttention and not config.enforce_eager
                           and config.tensor_parallel_size == 1)
        self.graph_sizes = [b for b in GRAPH_BATCH_SIZES if b <= sc.max_num_seqs]

    # --8<-- [start:attention_context]
    def _attention_context(self) -> type[PagedAttention]:
        """Which attention context every step builds: decided here, once."""
        own_op = self.backend.paged_attention is triton_paged_attention
        if self.device.type == "cuda" and own_op:
            # The kernel, reading device-side lengths (graph-capturable).
            return DeviceAttention
        if self.device.type == "cuda" or interpreting() or not own_op:
            # A swapped-in op (host lengths), or the interpreted kernels.
            return PagedAttention
        return PlannedAttention  # the kernel cannot run here: the vectorized CPU path
    # --8<-- [end:attention_context]

    def profile_num_blocks(self) -> int:
        sc = self.config.scheduler_config
        return profile_num_blocks(self.model, self.backend, self.config.block_size,
                                  sc.max_num_batched_tokens, sc.max_model_len,
                                  self.config.gpu_memory_utilization)

    # -- copying a step into the buffers --------------------------------------------------------
    # --8<-- [start:load]
    def _load(self, inputs: StepInputs, num_tokens: int, num_seqs: int) -> None:
        """Copy the step into the buffers' first rows.

        The rows after them are padded, up to num_tokens tokens and num_seqs sequences."""
        md = inputs.attn_metadata
        T, B = inputs.input_ids.shape[0], md.seq_lens.shape[0]
        width = md.block_tables.shape[1]
        self.input_ids[:T].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:T].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:T].copy_(md.slot_mapping, non_blocking=True)
        self.block_tables[:B, :width].copy_(md.block_tables, non_blocking=True)
        self.seq_lens[:B].copy_(md.seq_lens, non_blocking=True)
        self.query_start_loc[:B + 1].copy_(md.query_start_loc, non_blocking=True)
        if num_tokens > T:  # padding rows: token 0 at position 0, stored nowhere
            self.input_ids[T:num_tokens] = 0
            self.positions[T:num_tokens] = 0
            self.slot_mapping[T:num_tokens] = -1
        # Padding sequences: one query row each, reading one slot of block 0.
        if num_seqs > B:
            self.block_tables[B:num_seqs] = 0
            self.seq_lens[B:num_seqs] = 1
            self.query_start_loc[B + 1:num_seqs + 1] = torch.arange(
                T + 1, T + 1 + num_seqs - B, device=self.device, dtype=torch.int32)
    # --8<-- [end:load]

    def _metadata(self, inputs: StepInputs | None, num_tokens: int, num_seqs: int,
                  width: int) -> AttentionMetadata:
        host = inputs.attn_metadata if inputs is not None else None
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs, :width],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens_cpu=host.seq_lens_cpu if host else None,
            query_start_loc_cpu=host.query_start_loc_cpu if host else None)

    def _context(self, md: AttentionMetadata) -> PagedAttention:
        """The step's attention context, built once per step from its metadata."""
        return self.attention(md, self.k_caches, self.v_caches, self.backend, self.kv_quant)

    # -- the forward ----------------------------------------------------------------------------
    # --8<-- [start:execute]
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """logits [S, vocab] for the step's logits_indices rows."""
        T, B = inputs.input_ids.shape[0], inputs.attn_metadata.seq_lens.shape[0]
        if self.use_graphs and T == B and B <= max(self.graph_sizes, default=0):
            return self._replay(inputs, T)
        self._load(inputs, T, B)
        md = self._metadata(inputs, T, B, inputs.attn_metadata.block_tables.shape[1])
        ctx = self._context(md)
        forward = self.decode_step if self.decode_step and self.decode_step.runs(ctx) \
            else self.model
        return forward(self.input_ids[:T], self.positions[:T], ctx,
                       logits_indices=inputs.logits_indices)  # [S, vocab]

    def _replay(self, inputs: StepInputs, batch: int) -> torch.Tensor:
        """A decode step (one row per sequence) through the next captured size's graph."""
        size = next(b for b in self.graph_sizes if b >= batch)
        self._load(inputs, size, size)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[inputs.logits_indices]  # [S, vocab]; padding rows never sampled
    # --8<-- [end:execute]

    # --8<-- [start:capture]
    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record a forward of `size` decode rows over the buffers (whole block tables)."""
        md = self._metadata(None, size, size, self.max_blocks)
        ctx = self._context(md)

        def forward():
            return self.model(self.input_ids[:size], self.positions[:size], ctx)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool()):
            logits = forward()  # [size, vocab], rewritten in place by every replay
        return graph, logits
    # --8<-- [end:capture]

    def _pool(self):
        if not hasattr(self, "_graph_pool"):
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool
