"""MLA's paged absorbed decode kernel against its torch twin, on the CPU through Triton's
interpreter.

Every cache slot the kernel must not read is NaN: blocks in no table, slots past a sequence's
length, the block the padding entries of the block tables point at. The output is NaN before
the launch, so a row or head the kernel forgets shows; rows past the last sequence must come out
as 0, the twin's value. Batches are mostly decodes, with a few sequences of several query rows
(each reads only the keys up to its own position). Shapes are tiny: the interpreter runs one
program at a time in numpy.

The last test compiles the kernel's launches at DeepSeek-V2's sizes for sm_80 and sm_90 with
``pagedllm.kernels.compile_check`` (no GPU needed), as the engine's kernels are.
"""

import json
import os
import subprocess
import sys
import zlib

import pytest
import torch

from pagedllm.kernels.mla_decode import paged_mla_attention
from pagedllm.reference.ops.mla import paged_mla_attention as twin

DECODES = ((1, 37), (1, 8), (1, 1), (1, 64), (1, 17))
# several rows a sequence (speculative proposals, a short chunk), decodes between them
MIXED = ((3, 20), (1, 9), (5, 5), (2, 33))
PAD_ROWS = 2  # rows of q past the last sequence


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_batch(seed: int, block_size: int, heads: int, rank: int, rope: int, seqs=DECODES,
               pad_rows: int = PAD_ROWS, dtype=torch.float32, spare_blocks: int = 3):
    """Random q_latent, q_pe and a paged latent cache holding the sequences' rows in shuffled
    blocks, every other slot NaN. Returns q_latent, q_pe, kv_cache, block_tables, seq_lens,
    query_start_loc (int32)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    free = torch.randperm(num_blocks, generator=gen).tolist()
    poisoned = free.pop()  # what the padding entries of the tables point at: NaN
    kv_cache = torch.full((num_blocks, block_size, rank + rope), float("nan"))
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), poisoned, dtype=torch.int32)
    for b, (_, seq_len) in enumerate(seqs):
        for i in range(blocks_per_seq[b]):
            block = free.pop()
            block_tables[b, i] = block
            filled = min(block_size, seq_len - i * block_size)  # slots past seq_len stay NaN
            kv_cache[block, :filled] = torch.randn(filled, rank + rope, generator=gen)
    num_tokens = sum(q_len for q_len, _ in seqs) + pad_rows
    q_latent = torch.randn(num_tokens, heads, rank, generator=gen)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen)
    starts = [0]
    for q_len, _ in seqs:
        starts.append(starts[-1] + q_len)
    return (q_latent.to(dtype), q_pe.to(dtype), kv_cache.to(dtype), block_tables,
            torch.tensor([seq_len for _, seq_len in seqs], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32))


def check(batch, scale, tol, **kwargs):
    """Launch on a NaN-poisoned output and compare with the twin (in fp32)."""
    q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc = batch
    expected = twin(q_latent.float(), q_pe.float(), kv_cache.float(), block_tables, seq_lens,
                    query_start_loc, scale)
    out = torch.full_like(q_latent, float("nan"))
    got = paged_mla_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens,
                              query_start_loc, scale, out=out, **kwargs)
    assert got is out and got.dtype == q_latent.dtype
    assert not got.isnan().any(), "a row or head was left unwritten (or read a NaN slot)"
    assert (got.float() - expected).abs().max().item() < tol
    last = int(query_start_loc[-1])
    assert torch.equal(got[last:], torch.zeros_like(got[last:])), "padding rows must be 0"


# id: block_size, heads, kv_lora_rank, qk_rope_head_dim, sequences, launcher keywords
CASES = {
    "tiny-config-decodes": (16, 4, 32, 8, DECODES, {}),  # tiny_config("deepseek_v2")'s sizes
    "bs8-h20-two-head-blocks-mixed": (8, 20, 64, 16, MIXED, {}),  # the last block part masked
    "bs4-rank40-not-pow2": (4, 16, 40, 8, DECODES, {}),  # R pads to 64, P to 16
    "bs16-h32-block_h32-tile16-mixed": (16, 32, 32, 8, MIXED, {"block_h": 32, "tile_n": 16}),
    "bs32-h8-tile64": (32, 8, 16, 16, DECODES, {"tile_n": 64}),  # two blocks in a tile
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_matches_twin(case):
    block_size, heads, rank, rope, seqs, kwargs = CASES[case]
    batch = make_batch(zlib.crc32(case.encode()), block_size, heads, rank, rope, seqs)
    check(batch, (16 + rope) ** -0.5, 1e-4, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision(dtype):
    """bf16/fp16 inputs, fp32 softmax and accumulation; the twin in fp32 on the same rounded
    inputs is the truth: the kernel rounds the probabilities to the input type before the
    product with c_kv, and its output once."""
    batch = make_batch(zlib.crc32(str(dtype).encode()), 16, 16, 64, 16, MIXED, dtype=dtype)
    check(batch, 0.1, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_default_output_int64_metadata_and_no_padding():
    """Without out=, a fresh tensor; seq_lens / query_start_loc of another integer type; T
    ending exactly at the last sequence."""
    q_latent, q_pe, kv_cache, tables, seq_lens, starts = make_batch(5, 8, 4, 32, 8, MIXED,
                                                                    pad_rows=0)
    expected = twin(q_latent, q_pe, kv_cache, tables, seq_lens, starts, 0.2)
    got = paged_mla_attention(q_latent, q_pe, kv_cache, tables, seq_lens.long(),
                              starts.long(), 0.2)
    assert (got - expected).abs().max().item() < 1e-4


def test_without_the_interpreter_the_twin_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    batch = make_batch(9, 16, 4, 32, 8)
    assert torch.equal(paged_mla_attention(*batch, 0.2), twin(*batch, 0.2))


def test_bad_shapes_are_refused():
    q_latent, q_pe, kv_cache, tables, seq_lens, starts = make_batch(3, 16, 4, 32, 8)
    with pytest.raises(ValueError, match="must hold c_kv"):
        paged_mla_attention(q_latent, q_pe, kv_cache[..., :-1], tables, seq_lens, starts, 0.2)
    with pytest.raises(ValueError, match="a power of two >= 16"):
        paged_mla_attention(q_latent, q_pe, kv_cache, tables, seq_lens, starts, 0.2,
                            block_h=8)


RECORD = '''
import json, sys, torch
from pagedllm.kernels.compile_check import Recorder
from pagedllm.kernels.mla_decode import paged_mla_attention
from pagedllm.kernels.runtime import launch_hook
recorder = Recorder()
torch.manual_seed(0)
with launch_hook(recorder):
    # DeepSeek-V2's latent (512 + 64) and V2-Lite's 16 heads, each dtype; blocks of 16
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = torch.randn(4, 16, 576).to(dtype)
        tables = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
        paged_mla_attention(torch.randn(2, 16, 512).to(dtype), torch.randn(2, 16, 64).to(dtype),
                            kv, tables, torch.tensor([20, 17], dtype=torch.int32),
                            torch.tensor([0, 1, 2], dtype=torch.int32), 0.1)
json.dump(list(recorder.launches.values()), open(sys.argv[1], "w"))
'''


def test_the_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """The launches at real sizes compile for sm_80 and sm_90 and fit their shared memory
    (``kernels/compile_check.py``: record under the interpreter, compile in a fresh process)."""
    launches, results = tmp_path / "launches.json", tmp_path / "report.json"
    subprocess.run([sys.executable, "-c", RECORD, str(launches)], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"})
    recorded = json.loads(launches.read_text())
    assert len(recorded) == 3 and all(not r["constexprs"]["DOT_F32"] for r in recorded)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.kernels.compile_check", "compile",
                           "--launches", str(launches), "--json", str(results), "--targets",
                           "80,90", "--jobs", "2"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads(results.read_text())["results"]
    assert {r["capability"] for r in report} == {80, 90} and len(report) == 6
    assert all(r["ok"] for r in report), [r["error"] for r in report if not r["ok"]]
    print(done.stdout)
