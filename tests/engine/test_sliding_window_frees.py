"""A sliding window that gives its blocks back: a Mistral-style model (every layer reads the last
W tokens) holds at most ceil(W / block_size) + 1 blocks per decoding sequence, however long it
runs, and its tokens are those of the single-sequence loop, which keeps every token's K/V (the
window with freeing off). The null block that stands in for a freed block is safe to read for
every attention path, and the bookkeeping survives prefix caching, forks and both preemptions.
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.reference.kv import BlockSpaceManager
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

from ..conftest import INIT_STD
from .greedy_runs import check_shared_prefix_workload, greedy, no_leak, single_sequence_loop

WINDOW, BLOCK = 8, 4
BOUND = -(-WINDOW // BLOCK) + 1  # blocks a decoding sequence may hold: 3
PROMPT = list(range(5, 11))  # shorter than the window: the bound holds from the first step


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A random Mistral checkpoint with a window of 8 (the shared one has 16) and room for
    generations many windows long."""
    config = tiny_config("mistral", sliding_window=WINDOW, max_position_embeddings=512)
    return write_random_checkpoint(tmp_path_factory.mktemp("windowed") / "mistral", config,
                                   seed=0, init_std=INIT_STD)


@pytest.fixture(scope="module")
def long_windowed(tmp_path_factory):
    """The same model with 2,048 positions, for runs of thousands of tokens."""
    config = tiny_config("mistral", sliding_window=WINDOW, max_position_embeddings=2048)
    return write_random_checkpoint(tmp_path_factory.mktemp("long") / "mistral", config,
                                   seed=0, init_std=INIT_STD)


@pytest.fixture(scope="module")
def loop(windowed):
    """Greedy tokens of the single-sequence loop (a contiguous cache that keeps every K/V)."""
    return single_sequence_loop(windowed)


# -- the engine ---------------------------------------------------------------------------------
def test_long_generation_holds_only_the_window(tier, windowed, loop):
    """Three sequences of 126 tokens (15 windows) would need 96 blocks without freeing; the pool
    has 40, and none is ever preempted: each holds at most BOUND blocks at every step."""
    llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=40)
    kv = llm.engine.kv
    assert kv.null_block is not None  # the runner's spec is a sliding window
    seen = []

    def observe(engine, sched, inputs):
        held = [kv.num_held_blocks(item.seq) for item in sched.scheduled]
        assert max(held) <= BOUND, held
        for item in sched.scheduled:  # the placeholders lead the table, positions aligned
            (table,) = kv.get_block_ids(item.seq)
            skipped = len(table) - kv.num_held_blocks(item.seq)
            assert table[:skipped] == [kv.null_block] * skipped
            assert kv.null_block not in table[skipped:]
        seen.append(engine.stats()["blocks_used"])

    llm.engine.add_step_observer(observe)
    prompts = [{"prompt_token_ids": [t + i for t in PROMPT]} for i in range(3)]
    outs = llm.generate(prompts, greedy(tier, 120), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == loop(tuple(prompt["prompt_token_ids"]), 120)
    assert max(seen) <= 3 * BOUND and len(seen) >= 120
    stats = llm.stats()
    assert stats["preemptions_recompute"] == stats["preemptions_swap"] == 0
    no_leak(llm)


def test_two_thousand_tokens_hold_the_window_at_every_step(tier, long_windowed):
    """A prompt of 48 tokens and 2,000 generated ones (256 windows) in a pool of 8 blocks
    (32 token slots, fewer than the prompt): the prompt books its slots chunk by chunk (16
    tokens a step), so the blocks in use, counted through stats() at every step, never pass
    a window and a chunk's (7) and, once it decodes, BOUND; every block comes back. The
    tokens are those of a pool that holds every token (the single-sequence loop's, checked
    on the shorter runs above, would take most of this test's time over 2,048 positions)."""
    prompt = [(7 * i) % 250 for i in range(48)]
    peak = -(-(WINDOW - 1 + 16) // BLOCK) + 1
    runs = []
    for blocks in (8, 760):
        llm = tier.LLM(long_windowed, block_size=BLOCK, num_gpu_blocks=blocks,
                       enable_chunked_prefill=True, max_num_batched_tokens=16)
        used: list[int] = []
        llm.engine.add_step_observer(lambda e, s, i, used=used: used.append(
            e.stats()["blocks_used"]))
        out = llm.generate({"prompt_token_ids": prompt}, greedy(tier, 2000), use_tqdm=False)
        runs.append(out[0].outputs[0].token_ids)
        prefill_steps = 48 // 16
        assert len(used) == prefill_steps + 1999  # the prefill's last step draws token 1
        assert max(used) <= peak and max(used[prefill_steps:]) <= BOUND
        no_leak(llm)
    assert len(runs[0]) == 2000 and runs[0] == runs[1]


def test_a_prompt_longer_than_the_pool_runs_in_chunks(tier, windowed, loop):
    """60 prompt tokens and 20 more in a pool of 8 blocks (32 slots): chunked, each chunk
    books only what the window and the chunk need, and the tokens are the loop's. Unchunked,
    the prefill would need all 15 of its blocks in one step: refused at the door."""
    prompt = [(11 * i) % 250 for i in range(60)]
    llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=8, enable_chunked_prefill=True,
                   max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(tier, 20), use_tqdm=False)
    assert out[0].outputs[0].token_ids == loop(tuple(prompt), 20)
    no_leak(llm)
    whole = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="max_tokens"):
        whole.generate({"prompt_token_ids": prompt}, greedy(tier, 20), use_tqdm=False)


def test_a_long_prompt_frees_its_window_after_the_prefill(tier, windowed, loop):
    """A prompt of 5 windows in one step books all of its 10 blocks, and what the window
    left behind goes back right after the prefill. Chunked (16 tokens a step), it books each
    chunk as it comes (the pool books per chunk where every layer slides): 4 blocks, then
    the 2 the window still reads and 4 more, then 2 and 2, then the decodes' BOUND."""
    prompt = list(range(30, 70))
    for chunked, first_steps in ((False, [10, 3]), (True, [4, 6, 4, 3])):
        llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=16,
                       enable_chunked_prefill=chunked, max_num_batched_tokens=16 if chunked
                       else 512)
        used: list[int] = []
        llm.engine.add_step_observer(
            lambda e, s, i, used=used: used.append(e.stats()["blocks_used"]))
        out = llm.generate({"prompt_token_ids": prompt}, greedy(tier, 12), use_tqdm=False)
        assert out[0].outputs[0].token_ids == loop(tuple(prompt), 12)
        assert used[:len(first_steps)] == first_steps
        assert max(used[len(first_steps):]) <= BOUND  # the decodes
        no_leak(llm)


def test_prefix_cache_hits_only_blocks_still_there(tier, windowed, loop):
    """A second prompt sharing 7 blocks with the first: the blocks the first one's window gave
    back keep their content and key until handed out again, so the hit covers them; once other
    prompts took the pool, the hit stops at the first block handed out."""
    shared = list(range(100, 128))  # 7 blocks
    first, second = shared + [1, 2, 3], shared + [7, 8]
    llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=12, enable_prefix_caching=True)
    run = functools.partial(llm.generate, sampling_params=greedy(tier, 6), use_tqdm=False)
    assert run({"prompt_token_ids": first})[0].outputs[0].token_ids == loop(tuple(first), 6)
    assert run({"prompt_token_ids": second})[0].outputs[0].token_ids == loop(tuple(second), 6)
    hits = llm.stats()["prefix_cache_hit_blocks"]
    assert hits == 7
    for i in range(4):  # other prompts take every block in turn
        run({"prompt_token_ids": [i + 1] * 40})
    assert run({"prompt_token_ids": second})[0].outputs[0].token_ids == loop(tuple(second), 6)
    assert llm.stats()["prefix_cache_hit_blocks"] - hits < 7
    no_leak(llm)


request = st.tuples(st.integers(1, 2),  # n
                    st.integers(1, 14),  # prompt length after the optional shared prefix
                    st.booleans(),  # starts with the shared prefix
                    st.integers(8, 24))  # max_tokens


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(reqs=st.lists(request, min_size=2, max_size=4),
       mode=st.sampled_from(["swap", "recompute"]), prefix=st.booleans(),
       chunked=st.booleans())
def test_preemption_forks_and_prefix_caching_keep_the_tokens(tier, windowed, loop, reqs, mode,
                                                             prefix, chunked):
    """Greedy n > 1 samples (forked: the prompt's held blocks shared, copied on write), a
    shared prefix, chunked prefill or not, and a pool small enough to preempt: every sample's
    tokens are the single-sequence loop's, and nothing leaks."""
    check_shared_prefix_workload(tier, windowed, loop, reqs, mode, prefix, chunked,
                                 num_gpu_blocks=28)


def test_beam_search_shares_only_held_blocks(tier, windowed):
    """Beams fork and are dropped all along a search much longer than the window: a tight pool
    that swaps gives the beams of a roomy one, and every block comes back."""
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [9, 8, 7, 6, 5]}]
    params = tier.BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True)
    results = []
    for blocks in (200, 30):
        llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=blocks,
                       preemption_mode="swap", swap_space_blocks=64)
        outs = llm.beam_search(prompts, params, use_tqdm=False)
        results.append([[s.tokens for s in o.sequences] for o in outs])
        no_leak(llm)
    assert results[0] == results[1]


# -- the bookkeeping ----------------------------------------------------------------------------
def test_the_window_boundary_is_attention_s():
    """The token at position c reads keys > c - W (ops/attention.py): block i goes back once
    all its positions are <= c - W, that is once (i + 1) * block_size <= c - W + 1."""
    m = BlockSpaceManager(4, 10, sliding_window=6)
    m.allocate(0, 13)  # positions 0..12: blocks 0..3
    for computed, skipped in ((8, 0), (9, 1), (12, 1), (13, 2)):
        m.remove_skipped_blocks(0, computed)
        assert m.num_skipped_blocks(0) == skipped, computed
        # the next token (position `computed`) still has every key of its window
        assert all(m.block_ids(0)[p // 4] != m.gpu.null_block
                   for p in range(computed - 6 + 1, computed))
    assert m.num_free_gpu_blocks == 10 - 4 + 2
    with pytest.raises(ValueError, match="fell out of its sliding window"):
        m.slot(0, 7)  # in a block given back: the null block is never written
    with pytest.raises(ValueError, match="can keep between 8"):
        m.truncate(0, 4)
    m.free(0)
    assert m.num_free_gpu_blocks == 10


def test_swap_and_fork_move_and_share_only_held_blocks():
    m = BlockSpaceManager(4, 8, num_cpu_blocks=8, sliding_window=4)
    m.allocate(0, 20)  # 5 blocks
    assert m.remove_skipped_blocks(0, 20) == 4  # only position 19's block is read again
    m.fork(0, 1)
    assert m.gpu.ref_counts[m.block_ids(0)[-1]] == 2 and m.num_free_gpu_blocks == 7
    pairs = m.swap_out([0, 1])
    assert len(pairs) == 1 and m.num_free_gpu_blocks == 8 and m.num_free_cpu_blocks == 7
    assert m.block_ids(0)[:4] == [m.gpu.null_block] * 4
    assert len(m.swap_in([0, 1])) == 1 and m.num_free_cpu_blocks == 8
    assert m.block_ids(0)[:4] == [m.gpu.null_block] * 4 and m.num_held_blocks(1) == 1
    m.free(0)
    m.free(1)
    assert m.num_free_gpu_blocks == 8 and m.gpu.null_block not in m.gpu.free_list


def test_a_freed_block_is_found_only_while_its_content_is_there():
    """Keys of blocks given back stay findable until the block is handed out again; the null
    block is never registered."""
    m = BlockSpaceManager(4, 6, enable_prefix_caching=True, sliding_window=4)
    tokens = list(range(50, 67))  # 17 tokens: 4 full blocks
    m.allocate(0, 17, tokens)
    m.mark_computed(0, tokens, 17)
    m.remove_skipped_blocks(0, 17)
    assert m.num_skipped_blocks(0) == 3
    cache = m.prefix_cache
    assert m.gpu.null_block not in cache.key_of and len(cache.block_of) == 4
    # 3 hits behind the window cost nothing, the 4th is shared: only the 5th block is new
    assert m.num_new_blocks(17, tokens) == 1
    m.allocate(1, 17, tokens)  # a hit of 4 blocks: the first 3 are placeholders at once
    assert m.num_cached_tokens(1) == 16 and m.num_skipped_blocks(1) == 3
    m.free(0)
    m.free(1)
    for i in range(6):  # hand every block out again
        m.allocate(10 + i, 4, [9] * 4)
    assert cache.lookup(tokens) == []


def test_kinds_whose_blocks_differ_in_size_are_refused_by_name():
    from pagedllm.reference.kv import FullAttentionSpec, SlidingWindowSpec, group_layers

    window = SlidingWindowSpec(4, 1, 16, torch.float32, sliding_window=8)
    wider = FullAttentionSpec(4, 2, 16, torch.float32)  # two KV heads: twice the bytes
    with pytest.raises(ValueError, match="bytes a block"):
        group_layers([window, wider])
    with pytest.raises(ValueError, match="block_size"):
        from pagedllm.reference.kv import KVCacheGroupSpec, PagedKVCacheManager
        PagedKVCacheManager(8, 8, kv_cache_groups=(KVCacheGroupSpec((0,), window),))
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(4, 1, 16, torch.float32, sliding_window=0)


# -- the null block under every attention path --------------------------------------------------
def null_block_batch(window: int, block_size: int = 4, seqs=((1, 37), (5, 29), (1, 23))):
    """Random K/V for the sequences; returns the batch with intact tables, and the same batch
    whose blocks wholly before each sequence's window point at a zero null block while the
    blocks they replaced are NaN (as a block handed out to someone else may be)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 32
    per_seq = [-(-s // block_size) for _, s in seqs]
    num_blocks = sum(per_seq) + 1
    null = num_blocks - 1
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    k[null] = v[null] = 0
    tables = torch.full((len(seqs), max(per_seq)), null, dtype=torch.int32)
    ids = iter(torch.randperm(num_blocks - 1, generator=gen).tolist())
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor([next(ids) for _ in range(n)])
    freed_tables, freed_k, freed_v = tables.clone(), k.clone(), v.clone()
    for b, (q_len, seq_len) in enumerate(seqs):
        computed = seq_len - q_len  # the first query's position
        skipped = max(0, computed - window + 1) // block_size
        for i in range(skipped):
            freed_k[tables[b, i]] = freed_v[tables[b, i]] = float("nan")
            freed_tables[b, i] = null
        assert skipped > 0
    q = torch.randn(sum(q for q, _ in seqs), heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor([q for q, _ in seqs]).cumsum(0).tolist()],
                          dtype=torch.int32)
    lens = torch.tensor([s for _, s in seqs], dtype=torch.int32)
    return (q, k, v, tables, lens, starts), (q, freed_k, freed_v, freed_tables, lens, starts)


@pytest.mark.parametrize("path", ["reference", "optimized-cpu", "triton-interpret"])
def test_every_attention_path_masks_the_null_block(path, monkeypatch):
    window = 9
    intact, freed = null_block_batch(window)
    from pagedllm.reference.ops import paged_attention as twin

    want = twin(*intact, 0.3, window)
    if path == "reference":
        got = twin(*freed, 0.3, window)
    elif path == "optimized-cpu":  # the C++ decode kernel and the padded-batch path
        from pagedllm.optimized.attention import cpu_paged_attention

        got = cpu_paged_attention(*freed, 0.3, window)
        decodes = [freed[0][[0, 6]], *freed[1:3], freed[3][[0, 2]], freed[4][[0, 2]],
                   torch.arange(3, dtype=torch.int32)]
        expect = twin(intact[0][[0, 6]], *intact[1:3], intact[3][[0, 2]], intact[4][[0, 2]],
                      torch.arange(3, dtype=torch.int32), 0.3, window)
        assert torch.allclose(cpu_paged_attention(*decodes, 0.3, window), expect, atol=1e-4)
    else:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        from pagedllm.kernels.paged_attention import paged_attention

        got = paged_attention(*freed, 0.3, window)
    assert not got.isnan().any()
    assert torch.allclose(got, want, atol=1e-4)


def test_a_poisoned_pool_keeps_its_null_block_zero(tier, windowed, loop):
    """Every slot NaN but the null block's: the tokens are still the loop's, so no path read
    a slot it should not have, and the null block read as zeros."""
    llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=12)
    pool, null = llm.engine.runner.cache_engine, llm.engine.kv.null_block
    pool.fill_(float("nan"))
    assert pool.gpu_k[0].shape[0] == 13 == null + 1  # 12 blocks handed out, and the null one
    assert not pool.gpu_k[0][null].isnan().any() and pool.gpu_k[0][:null].isnan().all()
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(tier, 40), use_tqdm=False)
    assert out[0].outputs[0].token_ids == loop(tuple(PROMPT), 40)
    # the pool the engine counts is the blocks handed out; the planner prices them alike
    config = llm.engine.kv_cache_config
    assert llm.stats()["kv_cache_bytes"] == config.bytes_per_block * 12
    planned = kv_size(windowed, "float32")
    assert planned.bytes_per_token * BLOCK == config.bytes_per_block
    assert planned.held_blocks(10_000, BLOCK) == BOUND


def test_a_windowed_draft_proposes_fewer_tokens_than_its_window(tier, windowed):
    """A draft model's proposals move its window on; rolled back past blocks it gave back,
    it could not go on: num_speculative_tokens >= the draft's window is refused by name."""
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=40,
                 speculative_config={"model": str(windowed),
                                     "num_speculative_tokens": WINDOW})
    llm = tier.LLM(windowed, block_size=BLOCK, num_gpu_blocks=40,
                   speculative_config={"model": str(windowed),
                                       "num_speculative_tokens": WINDOW - 1})
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(tier, 20), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 20
    no_leak(llm)
