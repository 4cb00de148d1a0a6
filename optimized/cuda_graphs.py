"""CUDA graphs for decode steps: the Triton backend's whole-step slot, and its attention context.

A decode step launches a few kernels per layer, each doing microseconds of work after a few
microseconds of CPU-side launch cost; on a small model the GPU waits for the CPU. A CUDA graph
records the whole forward once per batch size and replays it with one launch. A decode batch
of B sequences is padded to the next captured size: the padding rows write their K/V nowhere
(slot -1), attend over one slot of block 0, and are never sampled. Fixed addresses are what
graphs need: the runner's persistent step buffers (``model_runner.py``) are them.
"""

import torch

from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.model import PagedAttention

# Decode batch sizes captured as CUDA graphs (vLLM captures 1, 2, 4 and multiples of 8).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes a runner captures: those its scheduler can reach."""
    return [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs]


class DeviceAttention(PagedAttention):
    """The engine's attention context, handing the kernels device-side lengths and offsets.

    The reference passes host copies (its loop needs Python ints). On CUDA the kernel needs only
    device tensors and finds its bounds from shapes, so passing them avoids a host-to-device
    copy per layer and lets the forward be captured in a CUDA graph.
    """

    def read(self, layer, q, scale, sliding_window=None):
        md = self.metadata_of(layer)
        return self.backend.paged_attention(
            q, self.k_caches[layer], self.v_caches[layer], md.block_tables, md.seq_lens,
            md.query_start_loc, scale, sliding_window, *self.quant.args(layer))


class CudaGraphs:
    """Decode steps replayed from graphs captured over the runner's buffers."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_sizes = graph_sizes(runner.config.scheduler_config.max_num_seqs)

    @classmethod
    def build(cls, runner) -> "CudaGraphs | None":
        """Graphs for a CUDA runner whose context reads device-side lengths; a
        tensor-parallel forward's all-reduces are not captured (gloo cannot be; NCCL
        untried)."""
        if runner.device.type != "cuda" or runner.attention is not DeviceAttention:
            return None
        if runner.config.model_config.is_mla:  # its decodes are picked out on the host
            return None
        return cls(runner)

    # --8<-- [start:replay]
    def __call__(self, inputs: StepInputs) -> torch.Tensor | None:
        """logits [S, vocab] for a decode step (one row per sequence) through the next
        captured size's graph; None for any other step (the runner runs it eagerly)."""
        T, B = inputs.input_ids.shape[0], inputs.attn_metadata.seq_lens.shape[0]
        if T != B or B > max(self.graph_sizes, default=0):
            return None
        size = next(b for b in self.graph_sizes if b >= B)
        self.runner.load(inputs, size, size)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[inputs.logits_indices]  # [S, vocab]; padding rows never sampled
    # --8<-- [end:replay]

    # --8<-- [start:capture]
    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record a forward of `size` decode rows over the buffers (whole block tables)."""
        runner = self.runner
        ctx = runner.context(None, size, size, runner.max_blocks)

        def forward():
            return runner.model(runner.input_ids[:size], runner.positions[:size], ctx)

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
