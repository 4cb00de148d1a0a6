"""A solution to lesson 14's exercise: the graph size of a decode step, and its padding.

The same rules as ``CudaGraphs.__call__`` and ``ModelRunner.load`` in
optimized/cuda_graphs.py and optimized/model_runner.py, on Python lists instead of the
runner's persistent buffers.
"""


def graph_size(batch: int, captured: list[int]) -> int | None:
    """The captured size a decode step of `batch` sequences runs at, or None to run eagerly."""
    return next((size for size in captured if size >= batch), None)


def pad_decode_step(input_ids: list[int], positions: list[int], slot_mapping: list[int],
                    block_tables: list[list[int]], seq_lens: list[int],
                    size: int) -> dict[str, list]:
    """A decode step of B sequences (one token row each), padded to `size` rows and sequences."""
    pad = size - len(input_ids)
    width = len(block_tables[0]) if block_tables else 0
    return {
        "input_ids": list(input_ids) + [0] * pad,  # any valid token
        "positions": list(positions) + [0] * pad,  # any valid position
        "slot_mapping": list(slot_mapping) + [-1] * pad,  # -1: store the K/V nowhere
        "block_tables": [list(row) for row in block_tables] + [[0] * width for _ in range(pad)],
        "seq_lens": list(seq_lens) + [1] * pad,  # attend over one slot of block 0
        "query_start_loc": list(range(size + 1)),  # one query row per sequence, padding too
    }
