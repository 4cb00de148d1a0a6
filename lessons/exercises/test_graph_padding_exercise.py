"""Checks lesson 14's exercise: a decode step padded to a captured graph size changes nothing.

    pytest lessons/exercises/test_graph_padding_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/graph_padding_exercise.py (skipped while the function it needs still raises
NotImplementedError). conftest.py loads both by file path, so lessons/ needs no __init__.py.

The reference is the optimized tier's ModelRunner (optimized/model_runner.py): its choice of
graph size and the buffers its ``_load`` fills for a padded decode step. The last tests run a
small random-weight Llama on your padded step, with the reference ops and with the optimized
tier's, and compare it with the unpadded step: the real rows' logits must be the same and the
padding must not have written a single slot of the KV cache.
"""


import pytest
import torch

from pagedllm import optimized
from pagedllm.optimized import CPU_BACKEND
from pagedllm.optimized.cuda_graphs import GRAPH_BATCH_SIZES, graph_sizes
from pagedllm.reference import load_model
from pagedllm.reference.model import AttentionMetadata, PagedAttention
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.ops import REFERENCE_BACKEND

EXERCISE = "graph_padding_exercise"  # impl (conftest.py): the solution's file, then yours
BLOCK_SIZE, NUM_BLOCKS = 4, 16

# A decode step of three sequences, blocks of 4 slots: 5, 9 and 2 tokens in the cache once
# this step's token is stored, so the new tokens sit at positions 4, 8 and 1.
STEP = dict(input_ids=[5, 17, 42], positions=[4, 8, 1],
            block_tables=[[3, 7, 0], [1, 4, 9], [12, 0, 0]], seq_lens=[5, 9, 2])
STEP["slot_mapping"] = [STEP["block_tables"][b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                        for b, p in enumerate(STEP["positions"])]  # [28, 36, 49]
KEYS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")


PROBES = {"graph_size": (1, [1]), "pad_decode_step": ([0], [0], [0], [[0]], [1], 1)}


def use(impl, function: str):
    """The function, or a skip while the learner's version still raises NotImplementedError."""
    return impl.use(function, *PROBES[function])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("graph-padding") / "llama",
                                   tiny_config("llama"), seed=0)


def runner_of(path, max_num_seqs: int, max_num_batched_tokens: int):
    """The optimized tier's model runner, as its engine builds it."""
    return optimized.LLM(path, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=64,
                         block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                         enable_chunked_prefill=True).engine.runner


def metadata(step: dict) -> AttentionMetadata:
    seq_lens = torch.tensor(step["seq_lens"], dtype=torch.int32)
    starts = torch.tensor(step.get("query_start_loc", range(len(seq_lens) + 1)),
                          dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(step["slot_mapping"]),
        block_tables=torch.tensor(step["block_tables"], dtype=torch.int32),
        seq_lens=seq_lens, query_start_loc=starts, seq_lens_cpu=seq_lens,
        query_start_loc_cpu=starts)


def test_graph_size_examples(impl):
    graph_size = use(impl, "graph_size")
    assert graph_size(5, [1, 2, 4, 8, 16]) == 8
    assert graph_size(16, [1, 2, 4, 8, 16]) == 16, ("a batch of a captured size is not padded"
                                                    "\n캡처된 크기의 배치는 패딩하지 않습니다")
    assert graph_size(17, [1, 2, 4, 8, 16]) is None, ("no graph holds 17: run eagerly"
                                                      "\n17을 담는 그래프가 없습니다: eager로 "
                                                      "실행합니다")
    assert graph_size(1, [1, 2, 4, 8, 16]) == 1
    assert graph_size(3, []) is None


@pytest.mark.parametrize("max_num_seqs", [1, 6, 24, 256])
def test_graph_size_is_the_runners(impl, max_num_seqs):
    """The model runner's captured sizes and its choice, for every batch it may see."""
    graph_size = use(impl, "graph_size")
    sizes = graph_sizes(max_num_seqs)  # what a runner with this max_num_seqs captures
    assert sizes == [b for b in GRAPH_BATCH_SIZES if b <= max_num_seqs]
    for batch in range(1, max_num_seqs + 1):
        if batch <= max(sizes):  # CudaGraphs: replay a graph
            expected = next(b for b in sizes if b >= batch)
        else:  # larger than every captured size (6 sequences, graphs of 1, 2 and 4): eager
            expected = None
        assert graph_size(batch, sizes) == expected, (
            f"batch {batch}"
            f"\n배치 {batch}")
    assert graph_size(GRAPH_BATCH_SIZES[-1] + 1, list(GRAPH_BATCH_SIZES)) is None


def test_pad_decode_step_example(impl):
    pad = use(impl, "pad_decode_step")
    padded = pad([5, 7], [3, 8], [3, 24], [[0, 0], [2, 6]], [4, 9], 4)
    assert padded == {"input_ids": [5, 7, 0, 0], "positions": [3, 8, 0, 0],
                      "slot_mapping": [3, 24, -1, -1],
                      "block_tables": [[0, 0], [2, 6], [0, 0], [0, 0]],
                      "seq_lens": [4, 9, 1, 1], "query_start_loc": [0, 1, 2, 3, 4]}
    unpadded = pad([5], [3], [3], [[0, 0]], [4], 1)
    assert unpadded["slot_mapping"] == [3] and unpadded["query_start_loc"] == [0, 1]


@pytest.mark.parametrize("size", [3, 4, 8, 16])
def test_pad_decode_step_is_the_runners(impl, tiny_llama, size):
    """Your padding equals what ModelRunner.load writes into its persistent buffers."""
    pad = use(impl, "pad_decode_step")
    padded = pad(*(STEP[k] for k in KEYS), size)
    runner = runner_of(tiny_llama, 16, 64)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc"):
        getattr(runner, name).fill_(99)  # stale values from an earlier step
    runner.block_tables.fill_(99)
    inputs = type("StepInputs", (), {})()  # the fields load reads
    inputs.input_ids, inputs.positions = torch.tensor(STEP["input_ids"]), torch.tensor(
        STEP["positions"])
    inputs.attn_metadata = metadata(STEP)
    runner.load(inputs, size, size)
    width = len(STEP["block_tables"][0])
    assert set(padded) == {*KEYS, "query_start_loc"}
    assert padded["input_ids"] == runner.input_ids[:size].tolist()
    assert padded["positions"] == runner.positions[:size].tolist()
    assert padded["slot_mapping"] == runner.slot_mapping[:size].tolist()
    assert padded["seq_lens"] == runner.seq_lens[:size].tolist()
    assert padded["query_start_loc"] == runner.query_start_loc[:size + 1].tolist()
    assert padded["block_tables"] == runner.block_tables[:size, :width].tolist()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", tiny_config("llama"),
                                   seed=0, init_std=0.2)
    return load_model(path)


def run_step(model, step: dict, caches, backend) -> torch.Tensor:
    k, v = caches
    attn = PagedAttention(metadata(step), k, v, backend)
    with torch.inference_mode():
        return model(torch.tensor(step["input_ids"]), torch.tensor(step["positions"]), attn)


@pytest.mark.parametrize("backend", [REFERENCE_BACKEND, CPU_BACKEND],
                         ids=["reference ops", "optimized ops"])
@pytest.mark.parametrize("captured", [GRAPH_BATCH_SIZES, (8, 16)])
def test_padding_changes_nothing(impl, model, backend, captured):
    """The padded step: same logits for the real rows, and no slot written by a padding row."""
    graph_size, pad = use(impl, "graph_size"), use(impl, "pad_decode_step")
    cfg = model.config
    shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    gen = torch.Generator().manual_seed(0)
    before = [[torch.randn(shape, generator=gen) for _ in range(cfg.num_layers)]
              for _ in range(2)]  # K and V caches of every layer, full of earlier tokens

    def fresh():
        return [[c.clone() for c in caches] for caches in before]

    plain_caches = fresh()
    plain = run_step(model, STEP, plain_caches, backend)  # [3, vocab]
    size = graph_size(len(STEP["input_ids"]), list(captured))
    assert size is not None and size >= 3
    padded_step = pad(*(STEP[k] for k in KEYS), size)
    padded_caches = fresh()
    padded = run_step(model, padded_step, padded_caches, backend)  # [size, vocab]
    assert padded.shape[0] == size
    torch.testing.assert_close(padded[:3], plain, msg=("the real rows' logits changed"
                                                       "\n실제 행의 로짓이 바뀌었습니다"))
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[STEP["slot_mapping"]] = True
    caches = zip(before, padded_caches, plain_caches, strict=True)
    for kind, (old, new, reference) in enumerate(caches):
        for layer in range(cfg.num_layers):
            flat_old = old[layer].flatten(0, 1)
            flat_new = new[layer].flatten(0, 1)
            assert torch.equal(flat_new[~written], flat_old[~written]), (
                f"{'KV'[kind]} cache of layer {layer}: a padding row wrote a slot"
                f"\n레이어 {layer}의 {'KV'[kind]} 캐시: 패딩 행이 슬롯에 썼습니다")
            torch.testing.assert_close(new[layer], reference[layer])
