"""Hybrid models: layers of several attention kinds, one block table per KV cache group.

A model that mixes windowed (local) and full (global) layers gets a KV cache group per kind
(``group_layers``), each with its own block tables over one shared pool: a windowed group gives
its blocks back as its window moves on, a full group keeps every token's. The tokens are the
single-sequence loop's (which keeps every K/V and masks the window), and transformers'.

The hybrid checkpoint here is a Qwen3 with ``layer_types`` (two sliding layers, one full), the
transformers class whose layers already mix kinds in the engine's Llama module; Gemma 3's
tests (tests/models/test_gemma3.py) run the same groups with its own model.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from pagedllm.reference.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    PagedKVCacheManager,
    SlidingWindowSpec,
    group_layers,
)
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import INIT_STD
from .greedy_runs import check_shared_prefix_workload, greedy, no_leak, single_sequence_loop

WINDOW, BLOCK = 8, 4
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a windowed group holds per decoding sequence: 3
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    config = tiny_config("qwen3", num_hidden_layers=3, layer_types=LAYER_TYPES,
                         sliding_window=WINDOW, use_sliding_window=True,
                         max_position_embeddings=512)
    return write_random_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen3", config,
                                   seed=0, init_std=INIT_STD)


@pytest.fixture(scope="module")
def loop(hybrid):
    """Greedy tokens of the single-sequence loop (every K/V kept, the window masked)."""
    return single_sequence_loop(hybrid)


# -- grouping ------------------------------------------------------------------------------------
def test_kinds_are_cut_into_groups_of_equal_size():
    full = FullAttentionSpec(16, 2, 64, torch.bfloat16)
    local = SlidingWindowSpec(16, 2, 64, torch.bfloat16, sliding_window=512)
    gemma = ([local] * 5 + [full]) * 2  # 12 layers, 5 local to 1 global
    groups = group_layers(gemma)
    assert [g.layer_ids for g in groups] == [(0, 1), (2, 3), (4, 6), (5, 11), (7, 8), (9, 10)]
    assert [type(g.kv_cache_spec) for g in groups].count(FullAttentionSpec) == 1
    config = KVCacheConfig(100, 0, groups)
    assert config.num_kv_tensors == 2 and config.num_layers == 12
    assert config.bytes_per_block == 2 * full.page_size_bytes  # a block is one group's
    assert [config.tensor_of_layer(i) for i in (0, 1, 5, 11)] == [0, 1, 0, 1]
    assert config.null_block == 100  # a windowed group frees: the pool has the null block
    (one,) = group_layers([full] * 4)  # one kind: one group, a tensor per layer
    assert one.layer_ids == (0, 1, 2, 3)


def test_groups_share_one_pool_and_count_hits_once():
    """Two groups over one pool: each sequence takes blocks in both; a prefix hit must hold in
    every group, and the windowed group's freed blocks go back to the shared free list."""
    full = FullAttentionSpec(BLOCK, 1, 8, torch.float32)
    local = SlidingWindowSpec(BLOCK, 1, 8, torch.float32, sliding_window=WINDOW)
    kv = PagedKVCacheManager(BLOCK, 40, enable_prefix_caching=True,
                             kv_cache_groups=group_layers([local, full]))
    assert kv.num_kv_cache_groups == 2 and kv.null_block == 40

    class Seq:
        def __init__(self, seq_id, tokens):
            self.seq_id, self.token_ids, self.output_token_ids = seq_id, tokens, []
            self.num_computed_tokens = 0

        def __len__(self):
            return len(self.token_ids)

    class Group:
        reads_prefix_cache = True

        def __init__(self, seq):
            self.seqs = [seq]

        def unfinished_seqs(self):
            return self.seqs

    prompt = list(range(100, 121))  # 21 tokens: 6 blocks in each group
    first = Seq(0, prompt)
    kv.admit(Group(first))  # the full group books the prompt; the windowed one, per chunk
    assert kv.num_free_blocks == 40 - 6 and kv.num_held_blocks(first) == 6
    kv.allocate_slots(first, 21)  # the prefill's one chunk, in the windowed group
    assert kv.num_free_blocks == 40 - 12 and kv.num_held_blocks(first) == 12
    first.num_computed_tokens = 21
    kv.mark_computed(first)  # the window left 3 blocks behind in the local group
    local_table, full_table = kv.get_block_ids(first)
    assert local_table[:3] == [kv.null_block] * 3 and kv.null_block not in full_table
    assert kv.num_free_blocks == 40 - 9
    second = Seq(1, prompt[:20] + [7])  # 5 full blocks shared
    (blocks,) = kv.admit(Group(second))
    assert blocks.num_cached_tokens == 20
    assert kv.prefix_cache_stats()["prefix_cache_hit_blocks"] == 5  # once, not per group
    kv.free_seq(first)
    kv.free_seq(second)
    assert kv.num_free_blocks == 40 and kv.num_seqs == 0


# -- the engine ----------------------------------------------------------------------------------
def test_tokens_equal_transformers_and_each_group_holds_its_own(tier, hybrid, loop):
    """Three sequences decoding 100 tokens: the windowed groups hold at most BOUND blocks a
    sequence, the full group every block; unused slots are NaN, so a read of a slot nobody
    wrote would show; the tokens are transformers' (and the loop's)."""
    prompts = [list(range(30 + i, 40 + i)) for i in range(3)]
    hf = AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32)
    ids = torch.tensor([prompts[0]])
    want = hf.generate(ids, max_new_tokens=100, do_sample=False)[0, 10:].tolist()
    assert len(want) > 50  # transformers stops at end-of-text; the engine here does not
    assert want == loop(tuple(prompts[0]), 100)[:len(want)]

    llm = tier.LLM(hybrid, block_size=BLOCK, num_gpu_blocks=200)
    kv = llm.engine.kv
    assert kv.num_kv_cache_groups == 3
    llm.engine.cache_engine.fill_(float("nan"))
    worst = []

    def observe(engine, sched, inputs):
        for item in sched.scheduled:
            tables = kv.get_block_ids(item.seq)
            end = item.seq.num_computed_tokens + item.num_tokens
            for spec, table in zip((g.kv_cache_spec for g in
                                    engine.kv_cache_config.kv_cache_groups), tables,
                                   strict=True):
                held = len(table) - table.count(kv.null_block)
                if isinstance(spec, SlidingWindowSpec):
                    assert held <= max(BOUND, -(-end // BLOCK)), (held, end)
                else:
                    assert held == -(-end // BLOCK) and kv.null_block not in table
        worst.append(engine.stats()["blocks_used"])

    llm.engine.add_step_observer(observe)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tier, 100),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == loop(tuple(prompt), 100)
    # at the end each sequence holds 28 blocks of full attention and 2 x BOUND windowed ones
    assert max(worst) <= 3 * (28 + 2 * BOUND)
    no_leak(llm)


request = st.tuples(st.integers(1, 2), st.integers(3, 30), st.booleans(), st.integers(1, 40))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request, min_size=2, max_size=4),
       mode=st.sampled_from(["swap", "recompute"]), prefix=st.booleans(),
       chunked=st.booleans())
def test_preemption_forks_and_prefix_caching_keep_the_tokens(tier, hybrid, loop, reqs, mode,
                                                             prefix, chunked):
    """n > 1 samples (forked in every group), a shared prefix, chunked prefill or not, and a
    pool small enough to preempt: the loop's tokens, and nothing leaks."""
    check_shared_prefix_workload(tier, hybrid, loop, reqs, mode, prefix, chunked,
                                 num_gpu_blocks=130, swap_space_blocks=200)


def test_a_tight_pool_preempts_and_gives_the_same_tokens(tier, hybrid, loop):
    """Four sequences of 60 tokens in a pool that cannot hold them together: both preemption
    modes run, every block comes back, the tokens are the loop's."""
    prompts = [list(range(10 * i, 10 * i + 12)) for i in range(4)]
    for mode in ("swap", "recompute"):
        llm = tier.LLM(hybrid, block_size=BLOCK, num_gpu_blocks=45, preemption_mode=mode,
                       swap_space_blocks=200)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(tier, 48),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == loop(tuple(prompt), 48)
        stats = llm.stats()
        assert stats[f"preemptions_{mode}"] > 0, stats
        no_leak(llm)


# -- what a token costs --------------------------------------------------------------------------
def test_the_planner_prices_each_group_as_the_engine_allocates(tier, hybrid):
    """Bytes per block = the tensors' rows the engine allocates for a block id; a sequence of
    T tokens holds ceil(T / block) full blocks and at most BOUND per windowed group."""
    llm = tier.LLM(hybrid, block_size=BLOCK, num_gpu_blocks=30)
    config = llm.engine.kv_cache_config
    pool = llm.engine.cache_engine
    per_block = sum(t[0].nbytes for t in (*pool.gpu_k, *pool.gpu_v))  # one row of each tensor
    assert per_block == config.bytes_per_block
    assert pool.nbytes() == 30 * per_block  # the null block's row aside
    size = kv_size(hybrid, "float32")
    assert size.bytes_per_block(BLOCK) == per_block
    T = 1000
    assert size.bytes_held(T, BLOCK) == (-(-T // BLOCK) + 2 * BOUND) * per_block
    # every layer keeping every token would cost 3 layers' K and V per token
    assert size.bytes_for(T) == T * 3 * per_block // BLOCK


def test_gemma_3_27b_holds_a_sixth_of_its_layers_at_long_context():
    """62 layers, 52 local over a window of 1,024 and 10 global: at 131,072 tokens the
    windowed groups hold their windows, the global group every block."""
    s = kv_size("gemma-3-27b", "bfloat16")
    groups = s.kv_cache_groups(16)
    assert sum(len(g.layer_ids) for g in groups) == 62 and len(groups[0].layer_ids) == 10
    T = 131_072
    held = s.bytes_held(T, 16)
    assert held < s.bytes_for(T) / 4  # every layer keeping every token: over 4x more
    assert held >= 10 * 2 * 16 * 128 * 2 * T  # the global layers' own K and V


# -- what the review found ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_kinds(tmp_path_factory):
    """One full layer, one windowed: a group each, of one layer."""
    config = tiny_config("qwen3", num_hidden_layers=2,
                         layer_types=["full_attention", "sliding_attention"],
                         sliding_window=WINDOW, use_sliding_window=True,
                         max_position_embeddings=512)
    return write_random_checkpoint(tmp_path_factory.mktemp("two") / "qwen3", config, seed=0,
                                   init_std=INIT_STD)


def test_every_group_takes_its_hit_before_any_takes_a_fresh_block(tier, two_kinds):
    """The second prompt shares 5 full blocks with the first. The full group's fresh blocks
    come from the oldest free ones, which are the windowed group's cached blocks the window
    gave back: had the full group taken its fresh blocks first, the windowed group would have
    lost its hit and read another layer's rows. Every group now takes its hits first."""
    loop = single_sequence_loop(two_kinds)
    first = list(range(100, 121))
    second = first[:20] + [7, 8, 9]
    llm = tier.LLM(two_kinds, block_size=BLOCK, num_gpu_blocks=16, enable_prefix_caching=True)
    for prompt, n in ((first, 3), (second, 6)):
        out = llm.generate({"prompt_token_ids": prompt}, greedy(tier, n), use_tqdm=False)
        assert out[0].outputs[0].token_ids == loop(tuple(prompt), n)
    assert llm.stats()["prefix_cache_hit_blocks"] == 5
    no_leak(llm)


def test_an_admission_that_fits_never_fails_the_running_requests(tier, two_kinds):
    """A 40-token prompt whose 8 cached blocks are partly free: admission once raised halfway
    (group 0 took blocks the windowed group's check had counted) and the step failed every
    running request. Now the running one goes on and both finish."""
    first = list(range(100, 133))
    engine = tier.LLM(two_kinds, block_size=BLOCK, num_gpu_blocks=24,
                      enable_prefix_caching=True).engine
    engine.add_request("running", list(range(50, 61)), greedy(tier, 4))
    engine.add_request("first", first, greedy(tier, 1))
    engine.step()
    engine.add_request("second", first[:32] + list(range(1, 9)), greedy(tier, 1))
    finished = set()
    for _ in range(20):
        finished |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert {"running", "second"} <= finished


def test_windowed_groups_of_a_hybrid_pool_book_chunk_by_chunk(tier, two_kinds):
    """10 prompt tokens and 90 more in 34 blocks: the full group needs 25 of them, the
    windowed group at most a window and a chunk (7). Chunked, the request runs with the
    loop's tokens; unchunked, a recompute would book all 100 tokens in both groups at once
    (50 blocks): refused at the door."""
    loop = single_sequence_loop(two_kinds)
    prompt = list(range(20, 30))
    llm = tier.LLM(two_kinds, block_size=BLOCK, num_gpu_blocks=34,
                   enable_chunked_prefill=True, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(tier, 90), use_tqdm=False)
    assert out[0].outputs[0].token_ids == loop(tuple(prompt), 90)
    no_leak(llm)
    with pytest.raises(ValueError, match="max_tokens"):
        tier.LLM(two_kinds, block_size=BLOCK, num_gpu_blocks=34).generate(
            {"prompt_token_ids": prompt}, greedy(tier, 90), use_tqdm=False)


def test_a_memory_budget_buys_blocks_at_a_hybrid_block_s_price(tier, hybrid):
    """kv_cache_memory in bytes: a block of three one-layer groups costs one layer's rows, so
    the budget buys three times the blocks every layer's rows would."""
    llm = tier.LLM(hybrid, block_size=BLOCK, kv_cache_memory=2**20)
    per_block = llm.engine.kv_cache_config.bytes_per_block
    assert llm.stats()["blocks_total"] == 2**20 // per_block
    assert 2**20 - per_block < llm.engine.cache_engine.nbytes() <= 2**20

