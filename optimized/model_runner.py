"""The model runner: a step's inputs in persistent buffers, the forward, a whole-step slot.

The reference builds every step's tensors afresh and hands them to the model. Here the step's
metadata is copied into buffers allocated once, at the largest size the scheduler allows
(max_num_batched_tokens rows, max_num_seqs sequences, max_model_len / block_size blocks each),
and the model reads views of them. Nothing about the step's content changes: the inputs are the
reference's ``prepare_inputs`` output, copied.

What else this runner owns: the merged projections (``layers.py``, done when it is built), the
KV pool's size on CUDA (``kv_sizing.py``), and the backend — chosen once, here, from the device
(``backend.py``: the Triton kernels on CUDA or under the interpreter, the C++ kernels on a CPU),
unless the engine was handed one. The backend packs the linear layers for its products, names
the step's attention context, and may run a whole step in one call: a CUDA graph replayed
(``cuda_graphs.py``), or on a CPU the decode step's layers in one C++ call
(``decode_step.py``). ``enforce_eager`` turns the whole step off.

Fixed addresses are what CUDA graphs need: a decode batch of B sequences is padded to the next
captured size, and the buffers' rows past the step's are the padding (``load``).
"""

import torch

from pagedllm.reference.engine.model_runner import ModelRunner as ReferenceModelRunner
from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.ops import Backend

from .backend import describe, select_backend
from .kv_sizing import profile_num_blocks
from .layers import merge_projections, transpose_linears


class ModelRunner(ReferenceModelRunner):
    tier = "optimized"
    runs_baselines = False  # paged layout and continuous batching only
    profiles_kv_cache = True
    captures_graphs = True

    def choose_backend(self, config, device: torch.device) -> Backend:
        """This tier's backend for the device, unless the engine was handed one."""
        return select_backend(device) if config.backend is None else config.backend

    def __init__(self, model, config, rank: int = 0):
        model = merge_projections(model)
        if next(model.parameters()).device.type == "cpu" and config.dtype == torch.float32:
            # BLAS's faster layout for few-row fp32 products; bf16/fp16 products are faster
            # in nn.Linear's own [out, in] layout (oneDNN's kernels; linear_layout.py).
            model = transpose_linears(model)
        super().__init__(model, config, rank)  # the backend packs the linear layers there
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
        # A backend handed in (a wrapper, a timer, a failing op) runs its ops as given, with
        # the reference's context (host lengths) and no whole step: a graph would capture
        # the swapped op, the C++ stack would skip it.
        own = self.backend is select_backend(self.device)
        context = self.backend.attention_context if own else None
        self.attention: type[PagedAttention] = context or PagedAttention
        # A CUDA graph, or the CPU's decode step in one call: off with enforce_eager, and
        # for a tensor-parallel forward, whose all-reduces neither can hold.
        self.whole_step = None if not own or config.enforce_eager \
            or config.tensor_parallel_size > 1 or self.backend.whole_step is None \
            else self.backend.whole_step(self)

    def kernels(self) -> dict[str, str]:
        """What computes each op of a step on this machine, and why (``backend.describe``)."""
        if self.backend is not select_backend(self.device):
            return {"every op": f"backend {self.backend.name!r} as the engine was handed it "
                                f"(EngineArgs.backend), with the reference's attention "
                                f"context and no whole step"}
        report = describe(self.backend, self.config.dtype)
        if self.whole_step is None:
            report["whole_step"] = ("none for this engine (enforce_eager, tensor parallelism, "
                                    "or a model the slot does not run): every step runs the "
                                    "modules")
        return report

    def profile_num_blocks(self) -> int:
        sc = self.config.scheduler_config
        return profile_num_blocks(self.model, self.backend,
                                  self.get_kv_cache_spec(self.config.block_size),
                                  sc.max_num_batched_tokens, sc.max_model_len,
                                  self.config.gpu_memory_utilization)

    # -- copying a step into the buffers --------------------------------------------------------
    # --8<-- [start:load]
    def load(self, inputs: StepInputs, num_tokens: int, num_seqs: int) -> None:
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

    def context(self, inputs: StepInputs | None, num_tokens: int, num_seqs: int,
                width: int) -> PagedAttention:
        """The step's attention context over the buffers' first rows, built once per step
        (the backend's context class; None inputs: a graph's capture, no host lengths)."""
        host = inputs.attn_metadata if inputs is not None else None
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs, :width],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens_cpu=host.seq_lens_cpu if host else None,
            query_start_loc_cpu=host.query_start_loc_cpu if host else None)
        return self.attention(md, self.k_caches, self.v_caches, self.backend, self.kv_quant)

    # -- the forward ----------------------------------------------------------------------------
    # --8<-- [start:execute]
    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """logits [S, vocab] for the step's logits_indices rows."""
        layer_metadata = self.layer_metadata(inputs)
        if layer_metadata is not None:
            # Several KV cache groups (a hybrid model): each layer reads its group's block
            # tables, from the step's own tensors; the buffers, and so a CUDA graph or the
            # one-call decode step, hold one group's.
            ctx = self.attention(inputs.attn_metadata, self.k_caches, self.v_caches,
                                 self.backend, self.kv_quant, layer_metadata)
            return self.model(inputs.input_ids, inputs.positions, ctx,
                              logits_indices=inputs.logits_indices)  # [S, vocab]
        if self.whole_step is not None:
            logits = self.whole_step(inputs)  # None: not a step it runs
            if logits is not None:
                return logits
        T, B = inputs.input_ids.shape[0], inputs.attn_metadata.seq_lens.shape[0]
        self.load(inputs, T, B)
        ctx = self.context(inputs, T, B, inputs.attn_metadata.block_tables.shape[1])
        return self.model(self.input_ids[:T], self.positions[:T], ctx,
                          logits_indices=inputs.logits_indices)  # [S, vocab]
    # --8<-- [end:execute]
