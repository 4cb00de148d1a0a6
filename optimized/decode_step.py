"""A decode step's layers in one C++ call: on a CPU, what the CUDA graph is on a GPU.

A decode step of one sequence multiplies one row by every weight. On SmolLM2 (30 layers) with
int8 weights the products read 163 MB, about 6 ms at this machine's 27 GB/s; the step took
14 ms, and after the products, the attention and the small kernels what was left was host
work: about ten Python-level operators a layer (module calls, views, splits, each dispatched
from Python at a microsecond or more), about 4.5 ms a step. A GPU runner hides that by
replaying a recorded graph; a CPU has no graph to replay, so ``kernels/cpu/decode_step.cpp`` holds
the layers' weights and strings the same kernels together itself: the same operators, in the
same order, on the same tensors, with the GIL released while it runs. The embedding before
the layers and the logits after them stay the model's own code.

It runs a step only where every layer is one it can run and every op is the tier's own:
a Llama-family model (no per-head q/k norms) in bf16 or float32 whose products are all on our
kernels (``quant_layers.py``) or, in float32, ATen's product on the transposed weight the
module holds (``layers.py``'s TransposedLinear: the module's own operator), an unquantized
cache of the model's dtype, a step of decodes only, and the backend's ops not swapped (a
test's failing op, a wrapper): anything else runs the modules as before. Its results are the
modules' results, bit for bit (``tests/engine/test_decode_step.py``), on every
instruction-set path the kernels have (``kernels/cpu/cpu.h``).
"""

from dataclasses import replace

import torch

from pagedllm.kernels.cpu_ops import FLOATS, CpuOp, cpu_extension
from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.reference.ops import Backend

from .attention import _decodes_only, rotary_tables
from .layers import MergedLlamaAttention, MergedLlamaMLP, TransposedLinear
from .quant_layers import PackedBF16Linear, PackedFp8Linear, PackedInt4Linear, PackedInt8Linear

NONE = torch.empty(0)  # a Product's tensor that its kind does not use
PACKED = (PackedInt8Linear, PackedInt4Linear, PackedFp8Linear, PackedBF16Linear)
PRODUCTS = (*PACKED, TransposedLinear)  # what _product takes
DTYPES = (torch.bfloat16, torch.float32)  # the models the stack runs


def _product(ext, module):
    """A linear layer (one of PRODUCTS) as the C++ stack's Product."""
    if isinstance(module, TransposedLinear):  # a float32 model's weight, [in, out]
        return ext.Product("dense", module.weight_t, NONE, NONE, module.bias, 0)
    if isinstance(module, PackedInt8Linear):
        return ext.Product("int8", module.packed, module.scales, module.qsum, module.bias, 0)
    if isinstance(module, PackedInt4Linear):
        return ext.Product("int4", module.packed, module.scales, module.zeros, module.bias,
                           module.group_size)
    if isinstance(module, PackedFp8Linear):
        return ext.Product("fp8", module.packed, module.scales, NONE, module.bias, 0)
    return ext.Product("bf16", module.packed, NONE, NONE, module.bias, 0)  # PackedBF16Linear


def _ops(backend: Backend) -> tuple:
    """The ops the stack computes itself, with the same kernels."""
    return (backend.rms_norm, backend.store_kv, backend.paged_attention, backend.rotary,
            backend.silu_and_mul)


class DecodeStep:
    """The model's decoder layers as one C++ stack, for the steps it can run."""

    def __init__(self, ext, model: LlamaForCausalLM, inv_freq: torch.Tensor, ops: tuple,
                 dtype: torch.dtype):
        self.model, self.inv_freq, self.ops, self.dtype = model, inv_freq, ops, dtype
        self.stack = ext.DecodeStack()
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.stack.add_layer(ext.Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps, _product(ext, attn.qkv_proj),
                _product(ext, attn.o_proj), _product(ext, mlp.gate_up_proj),
                _product(ext, mlp.down_proj), attn.num_heads, attn.num_kv_heads,
                attn.head_dim, attn.sliding_window or 0, attn.scale))

    @classmethod
    def build(cls, model, backend: Backend, dtype: torch.dtype) -> "DecodeStep | None":
        """The stack for this model and backend, or None where it cannot stand in for the
        modules (the module docstring lists when)."""
        ops = _ops(backend)
        # Ops swapped in (a wrapper, a timer, a failing op) are not CpuOps: the modules run
        # them as they are.
        # A dtype the ops leave to their twins would give the modules other sums than the
        # kernels': the stack runs the dtypes the ops run their kernels in.
        if dtype not in DTYPES or dtype not in FLOATS or type(model) is not LlamaForCausalLM \
                or not all(isinstance(op, CpuOp) for op in ops) \
                or (ext := cpu_extension()) is None:
            return None
        layers = list(model.model.layers)
        if not layers:
            return None
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not (type(layer) is LlamaDecoderLayer and type(attn) is MergedLlamaAttention
                    and type(mlp) is MergedLlamaMLP and not attn.qk_norm
                    and attn.head_dim in (32, 64)
                    and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
                    and layer.input_layernorm.weight.dtype == dtype
                    and all(isinstance(m, PRODUCTS) for m in (
                        attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
                return None
        inv_freq = layers[0].self_attn.inv_freq
        if any(not torch.equal(layer.self_attn.inv_freq, inv_freq) for layer in layers):
            return None  # one rotary table a step
        return cls(ext, model, inv_freq, ops, dtype)

    @classmethod
    def for_runner(cls, runner) -> "RunnerDecodeStep | None":
        """The CPU backend's whole-step slot: the stack for the runner's model, or None."""
        step = cls.build(runner.model, runner.backend, runner.config.dtype)
        return None if step is None else RunnerDecodeStep(runner, step)

    @staticmethod
    def requirements() -> str:
        return ("decode steps (and speculative runs' few rows a sequence, one query a row) of "
                "a Llama-family bf16 or float32 model whose products are all packed (or float32 "
                "dense), over an unquantized cache of the model's dtype, with the backend's own "
                "ops (not enforce_eager, not tensor-parallel); any other step runs the modules")

    def runs(self, attn) -> bool:
        """Whether this step's attention context is one the stack reads: decodes only, an
        unquantized cache of the model's dtype."""
        md = attn.metadata
        return (md.query_start_loc_cpu is not None
                and _decodes_only(md.query_start_loc_cpu, md.slot_mapping.shape[0])
                and attn.quant.rotation is None and not attn.quant.args(0)
                and not attn.quant.calculate_scales
                and attn.k_caches[0].dtype == self.dtype)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attn,
                 logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """What the model's forward returns for this step: logits [S, vocab]."""
        md = attn.metadata
        x = self.model.model.embed_tokens(token_ids)  # [S, hidden]
        cos, sin = rotary_tables(positions, self.inv_freq, x.dtype)  # [S, 1, head_dim]
        # named for torch.profiler, which cannot see inside one C++ call (race_profile.py)
        with torch.profiler.record_function("pagedllm::decode_layers"):
            x, residual = self.stack.forward(
                x.contiguous(), cos.contiguous(), sin.contiguous(), attn.k_caches,
                attn.v_caches, md.block_tables, md.seq_lens_cpu, md.slot_mapping)
        return self.model.compute_logits(x, residual, attn.backend, logits_indices)


MAX_ROWS_A_SEQUENCE = 16  # a speculative run's k + 1 rows; a longer chunk is a prompt's


def one_query_per_row(inputs: StepInputs) -> StepInputs | None:
    """A step whose sequences compute a few rows each (a speculative run: the last token and
    its k proposals) as one query per row, which the decode kernel takes: row i attends to the
    first positions[i] + 1 tokens of its sequence's block table, as a sequence of its own whose
    last token it is. Each layer stores every row's K/V before any row attends, so a row sees
    the rows before it and none after, as causal attention does. None unless every row is
    sampled and no sequence has more than MAX_ROWS_A_SEQUENCE rows: a prompt's chunk keeps the
    modules' prefill."""
    md = inputs.attn_metadata
    T = inputs.input_ids.shape[0]
    rows = md.query_start_loc_cpu.diff()  # [B] rows of each sequence
    sampled = torch.unique(inputs.logits_indices.cpu())
    if int(rows.max()) > MAX_ROWS_A_SEQUENCE or not torch.equal(sampled, torch.arange(T)):
        return None
    owner = torch.repeat_interleave(torch.arange(rows.shape[0]), rows)  # [T] each row's seq
    seq_lens_cpu = (inputs.positions.cpu() + 1).to(md.seq_lens_cpu.dtype)  # [T]
    starts_cpu = torch.arange(T + 1, dtype=md.query_start_loc_cpu.dtype)  # [T + 1]
    per_row = replace(md, block_tables=md.block_tables[owner.to(md.block_tables.device)],
                      seq_lens=seq_lens_cpu.to(md.seq_lens), seq_lens_cpu=seq_lens_cpu,
                      query_start_loc=starts_cpu.to(md.query_start_loc),
                      query_start_loc_cpu=starts_cpu)
    return replace(inputs, attn_metadata=per_row)


class RunnerDecodeStep:
    """The stack in the runner's whole-step slot: a step it runs is loaded into the runner's
    buffers and computed in one call; any other is left to the runner (None). A speculative
    step's few rows a sequence run as one query a row (``one_query_per_row``), where the
    buffers hold as many sequences."""

    def __init__(self, runner, step: DecodeStep):
        self.runner, self.step = runner, step

    def __call__(self, inputs: StepInputs) -> torch.Tensor | None:
        T, B = inputs.input_ids.shape[0], inputs.attn_metadata.seq_lens.shape[0]
        if T != B:
            if T > self.runner.seq_lens.shape[0] or \
                    inputs.attn_metadata.query_start_loc_cpu is None:
                return None
            inputs = one_query_per_row(inputs)
            if inputs is None:
                return None
            B = T
        runner = self.runner
        runner.load(inputs, T, B)
        ctx = runner.context(inputs, T, B, inputs.attn_metadata.block_tables.shape[1])
        if not self.step.runs(ctx):
            return None
        return self.step(runner.input_ids[:T], runner.positions[:T], ctx,
                         logits_indices=inputs.logits_indices)  # [S, vocab]
