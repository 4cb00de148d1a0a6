"""Milestone 5, the step's inputs: the flat tensors of one step, checked on a worked example,
then fed to milestone 1's pool step after step while milestones 2-3 schedule a workload.

    pytest lessons/build/test_build_step_inputs.py

Each test runs on the solution and on lessons/build/step_inputs.py (skipped until written).
The other pieces are yours once written.
"""

import torch
from build_types import ScheduledSeq, SchedulerOutput, Sequence

from pagedllm.reference.ops import causal_attention

PIECE = "step_inputs"


class Tables:
    """The two things build_step_inputs asks a block manager: block_size, block_table."""

    def __init__(self, block_size: int, tables: dict[int, list[int]]):
        self.block_size, self.tables = block_size, tables

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.tables[seq_id])


def seq(seq_id: int, n: int, computed: int) -> Sequence:
    """n tokens (ids 100 * seq_id + position), the first `computed` of them in the cache."""
    prompt = [100 * seq_id + p for p in range(n)]
    return Sequence(seq_id, prompt, 4, seq_id, num_computed_tokens=computed)


def test_worked_example(impl):
    a, b, c, d = seq(0, 6, 0), seq(1, 10, 9), seq(2, 11, 8), seq(3, 10, 0)
    out = SchedulerOutput([ScheduledSeq(a, 6),  # a whole prompt
                           ScheduledSeq(b, 1),  # a decode at position 9
                           ScheduledSeq(c, 3),  # a prompt whose first 8 tokens were cached
                           ScheduledSeq(d, 4)])  # a chunk that does not reach the end
    tables = Tables(4, {0: [7, 2], 1: [4, 0, 5], 2: [1, 3, 6], 3: [8, 9, 10]})
    got = impl.build_step_inputs(out, tables)
    want = dict(
        input_ids=[0, 1, 2, 3, 4, 5, 109, 208, 209, 210, 300, 301, 302, 303],
        positions=[0, 1, 2, 3, 4, 5, 9, 8, 9, 10, 0, 1, 2, 3],
        slot_mapping=[28, 29, 30, 31, 8, 9, 21, 24, 25, 26, 32, 33, 34, 35],
        block_tables=[[7, 2, 0], [4, 0, 5], [1, 3, 6], [8, 9, 10]],
        seq_lens=[6, 10, 11, 4],
        query_start_loc=[0, 6, 7, 10, 14],
        logits_indices=[5, 6, 9])
    why = dict(
        slot_mapping="slot = block_table[p // block_size] * block_size + p % block_size",
        block_tables=("one row per sequence, padded with 0 to the longest"
                      "\n시퀀스마다 한 행, 가장 긴 시퀀스에 맞춰 0으로 패딩"),
        seq_lens=("tokens in the cache once this step's are stored: computed + scheduled"
                  "\n이 스텝의 토큰까지 저장한 뒤 캐시에 있는 토큰 수: 계산된 토큰 + 스케줄된 "
                  "토큰"),
        query_start_loc=("0, then the end of each sequence's rows"
                         "\n0, 그다음 시퀀스마다 그 행들이 끝나는 위치"),
        logits_indices=("each sequence that samples (reaches its last token), the row of "
                        "its last token; the chunk of sequence 3 samples nothing"
                        "\n샘플링하는 시퀀스(마지막 토큰에 이르는 시퀀스)마다 그 마지막 토큰의 "
                        "행; 시퀀스 3의 청크는 아무것도 샘플링하지 않습니다"))
    dtypes = dict(input_ids=torch.int64, positions=torch.int64, slot_mapping=torch.int64,
                  block_tables=torch.int32, seq_lens=torch.int32, query_start_loc=torch.int32,
                  logits_indices=torch.int64)
    for name, value in want.items():
        tensor = getattr(got, name)
        assert tensor.dtype == dtypes[name], (f"{name}: {dtypes[name]}, got {tensor.dtype}"
                                              f"\n{name}: 기대 dtype {dtypes[name]}, 결과 "
                                              f"{tensor.dtype}")
        assert tensor.tolist() == value, \
            f"{name}: expected {value}, got {tensor.tolist()} ({why.get(name, '')})"


def test_inputs_drive_the_pool(impl, parts):
    """A modelless engine: each token's K/V is a function of (sequence, position). Every step,
    your inputs place them (store_kv) and read them back (paged_attention); each query row
    must see exactly its sequence's history, across admissions, decodes and preemptions."""
    torch.manual_seed(0)
    kvh, hd, heads, bs, num_blocks = 1, 4, 2, 2, 9
    table_k, table_v = torch.randn(8, 32, kvh, hd), torch.randn(8, 32, kvh, hd)  # [seq, pos]
    bm = parts.BlockManager(num_blocks, bs)
    scheduler = parts.Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=32)
    k_caches, v_caches = parts.allocate_kv_cache(1, num_blocks, bs, kvh, hd)
    k_caches[0].fill_(float("nan"))  # a slot read before it is written spoils the output
    v_caches[0].fill_(float("nan"))
    seqs = [Sequence(i, [i] * n, m, i) for i, (n, m) in enumerate([(3, 6), (5, 4), (2, 7),
                                                                    (4, 3), (1, 5)])]
    for s in seqs:
        scheduler.add(s)
    steps = preempted = 0
    while scheduler.has_unfinished():
        assert steps < 200, ("the workload does not finish"
                             "\n워크로드가 끝나지 않습니다")
        out = scheduler.schedule()
        parts.copy_blocks(k_caches, v_caches, out.blocks_to_copy)
        preempted += len(out.preempted)
        if out.scheduled:
            inputs = impl.build_step_inputs(out, bm)
            ids = [item.seq.seq_id for item in out.scheduled for _ in range(item.num_tokens)]
            k = table_k[ids, inputs.positions]  # [T, kvh, hd]
            v = table_v[ids, inputs.positions]
            q = torch.randn(len(ids), heads, hd)
            parts.store_kv(k, v, k_caches[0], v_caches[0], inputs.slot_mapping)
            got = parts.paged_attention(q, k_caches[0], v_caches[0], inputs.block_tables,
                                        inputs.seq_lens, inputs.query_start_loc, 0.5)
            row = 0
            for item in out.scheduled:
                s, n = item.seq, item.seq.num_computed_tokens + item.num_tokens
                pos = torch.arange(n)
                want = causal_attention(q[row:row + item.num_tokens], table_k[s.seq_id, :n],
                                        table_v[s.seq_id, :n], pos[n - item.num_tokens:],
                                        pos, 0.5)
                torch.testing.assert_close(got[row:row + item.num_tokens], want, msg=(
                    f"step {steps}, sequence {s.seq_id} ({item.num_tokens} of {n} tokens): "
                    "the attention over the pool read something else than its history "
                    "(NaN: an unwritten slot). Check slot_mapping, block_tables, seq_lens "
                    "and query_start_loc against each other"
                    f"\n스텝 {steps}, 시퀀스 {s.seq_id} (토큰 {n}개 중 {item.num_tokens}개): 풀 "
                    "위의 어텐션이 그 시퀀스의 이력이 아닌 것을 읽었습니다(NaN이면 아무도 쓰지 "
                    "않은 슬롯). slot_mapping, block_tables, seq_lens, query_start_loc을 서로 "
                    "맞춰 확인하세요"))
                row += item.num_tokens
            ends = inputs.query_start_loc.tolist()[1:]
            sampling = [e - 1 for item, e in zip(out.scheduled, ends, strict=True)
                        if item.samples]
            assert inputs.logits_indices.tolist() == sampling, (
                f"step {steps}: logits_indices, the last row of each sampling sequence"
                f"\n스텝 {steps}: logits_indices는 샘플링하는 시퀀스마다 그 마지막 행입니다")
            scheduler.update(out, [7] * len(sampling))
        steps += 1
    assert preempted > 0, ("the workload was meant to preempt: the test is too easy"
                           "\n워크로드는 선점을 일으키도록 만든 것입니다: 테스트가 너무 쉽습니다")
