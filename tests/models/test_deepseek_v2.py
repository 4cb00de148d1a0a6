"""DeepSeek-V2 (dense MLPs, multi-head latent attention) computes what transformers computes.

The model runs with its one-sequence latent cache: a prompt in the expanded form, each decode
in the absorbed form (``reference/ops/mla.py``). The two forms agree with each other and with
transformers; the paged op (``store_latent``, ``paged_mla_attention``) and the Triton kernel
agree with them through a paged context written here the way the engine's will be. What the
reference does not run (mixture-of-experts layers, YaRN) is refused by name, and the engine
refuses MLA checkpoints until its paged cache holds latents.
"""


import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config

from pagedllm.reference import NoCache, load_config, load_model
from pagedllm.reference.model.config import from_hf_config
from pagedllm.reference.model.deepseek_v2 import mla_kv_bytes_per_token
from pagedllm.reference.model.latent_cache import ContiguousLatentCache
from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint
from pagedllm.reference.ops.mla import (
    absorb_query,
    mla_absorbed_attention,
    mla_expanded_attention,
    paged_mla_attention,
    store_latent,
    unabsorb_output,
)

from ..conftest import INIT_STD

LOGIT_TOL = 1e-4  # max abs difference, float32 (measured below 1e-5)
PROMPT_LENGTHS = (1, 7, 40)  # 1: a single-token prompt takes the absorbed form
VARIANTS = {
    "plain": {},  # q_proj, untied
    # the query's low-rank bottleneck, a bias on the "a" projections and o_proj, tied head
    "q_lora": dict(q_lora_rank=24, attention_bias=True, tie_word_embeddings=True),
    "linear_rope": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v2")
    return {name: write_random_checkpoint(root / name, tiny_config("deepseek_v2", **kw),
                                          seed=i, init_std=INIT_STD)
            for i, (name, kw) in enumerate(VARIANTS.items())}


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length
    return model


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (length,), generator=torch.Generator().manual_seed(seed))


def greedy(model, prompt: list[int], n: int, context) -> list[int]:
    """Prefill the prompt, then n - 1 decode steps of one token each through context."""
    logits = model(torch.tensor(prompt), torch.arange(len(prompt)), context)[-1]
    tokens = [int(logits.argmax())]
    while len(tokens) < n:
        position = torch.tensor([len(prompt) + len(tokens) - 1])
        logits = model(torch.tensor(tokens[-1:]), position, context)[-1]
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(checkpoints, variant):
    ref, hf = load_model(checkpoints[variant]), hf_model(checkpoints[variant])
    for length in PROMPT_LENGTHS:
        ids = random_prompt(length, seed=length)
        cache = ContiguousLatentCache.for_config(ref.config, 64)
        with torch.no_grad():
            expected = hf(ids[None]).logits[0]  # [T, vocab]
            got = ref(ids, torch.arange(length), cache)
        diff = (expected - got).abs().max().item()
        assert diff <= LOGIT_TOL, f"{variant}, {length} tokens: max |logit diff| {diff:.2e}"
        assert set(cache.forms_used) == {"absorbed" if length == 1 else "expanded"}


@pytest.mark.parametrize("variant", ["plain", "q_lora"])
def test_greedy_generation_matches_transformers(checkpoints, variant):
    """The prompt in the expanded form, every new token in the absorbed one."""
    ref, hf = load_model(checkpoints[variant]), hf_model(checkpoints[variant])
    ids = random_prompt(9, seed=1)
    expected = hf.generate(ids[None], attention_mask=torch.ones(1, 9, dtype=torch.long),
                           max_new_tokens=24, do_sample=False)[0, 9:].tolist()
    cache = ContiguousLatentCache.for_config(ref.config, 9 + 24)
    with torch.no_grad():
        assert greedy(ref, ids.tolist(), 24, cache) == expected
    layers = ref.config.num_layers
    assert cache.forms_used == {"expanded": layers, "absorbed": 23 * layers}
    assert cache.num_cached_tokens == 9 + 23


def test_expanded_and_absorbed_forms_agree(checkpoints):
    """The whole model, either form for every call: a prompt, then decode steps."""
    model = load_model(checkpoints["q_lora"])
    ids = random_prompt(30, seed=3)
    runs = {}
    for form in ("expanded", "absorbed"):
        cache = ContiguousLatentCache.for_config(model.config, 32, form=form)
        with torch.no_grad():
            prompt = model(ids[:28], torch.arange(28), cache)
            steps = [model(ids[i:i + 1], torch.tensor([i]), cache) for i in (28, 29)]
        runs[form] = torch.cat([prompt, *steps])
        assert set(cache.forms_used) == {form}
    torch.testing.assert_close(runs["absorbed"], runs["expanded"], atol=2e-5, rtol=0)


def test_the_two_forms_are_equal_ops():
    """The ops alone, in float64: decompress-then-attend equals attend-in-the-latent-space."""
    gen = torch.Generator().manual_seed(0)
    T, S, H, N, P, R, V = 5, 12, 3, 16, 8, 32, 12

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    args = (rand(T, H, N), rand(T, H, P), rand(S, R), rand(S, P), rand(H, N, R), rand(H, R, V),
            torch.arange(S - T, S), torch.arange(S), (N + P) ** -0.5)
    expanded, absorbed = mla_expanded_attention(*args), mla_absorbed_attention(*args)
    assert expanded.shape == (T, H, V)
    torch.testing.assert_close(absorbed, expanded, atol=1e-12, rtol=0)


def test_paged_op_matches_the_dense_forms():
    """store_latent into shuffled blocks (a padding row with slot -1 not stored), then the paged
    absorbed op: the same result as the expanded form per sequence, query rows causal."""
    gen = torch.Generator().manual_seed(1)
    H, N, P, R, V, block_size = 4, 16, 8, 32, 16, 4
    seqs = ((1, 9), (3, 6), (1, 1))  # (q_len, seq_len): a decode, three rows, a first token
    kv_cache = torch.full((12, block_size, R + P), float("nan"))  # never-written slots: NaN
    blocks = torch.randperm(12, generator=gen).to(torch.int32)
    tables = torch.stack([blocks[0:3], blocks[3:6], blocks[6:9]])
    w_uk, w_uv = torch.randn(H, N, R, generator=gen), torch.randn(H, R, V, generator=gen)
    latents = [torch.randn(s, R + P, generator=gen) for _, s in seqs]
    # position p of sequence b: slot tables[b, p // block_size] * block_size + p % block_size
    slots = torch.cat([tables[b].long()[torch.arange(s) // block_size] * block_size
                       + torch.arange(s) % block_size for b, (_, s) in enumerate(seqs)])
    rows = torch.cat(latents)  # [16, R + P]
    ones = torch.ones(1, R + P)  # a padding row (slot -1): must not be written anywhere
    store_latent(torch.cat([rows, ones])[:, :R], torch.cat([rows, ones])[:, R:], kv_cache,
                 torch.cat([slots, torch.tensor([-1])]))
    assert int(kv_cache.isnan().any(-1).logical_not().sum()) == len(slots)
    starts = torch.tensor([0, 1, 4, 5])
    T = 5 + 2  # two padding rows after the last sequence
    q_nope, q_pe = torch.randn(T, H, N, generator=gen), torch.randn(T, H, P, generator=gen)
    out_latent = paged_mla_attention(absorb_query(q_nope, w_uk), q_pe, kv_cache, tables,
                                     torch.tensor([s for _, s in seqs]), starts, 0.2)
    got = unabsorb_output(out_latent, w_uv)  # [T, H, V]
    for b, (q_len, seq_len) in enumerate(seqs):
        r = slice(int(starts[b]), int(starts[b + 1]))
        keys = torch.arange(seq_len)
        want = mla_expanded_attention(q_nope[r], q_pe[r], latents[b][:, :R], latents[b][:, R:],
                                      w_uk, w_uv, keys[seq_len - q_len:], keys, 0.2)
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=0)
    assert torch.equal(got[5:], torch.zeros(2, H, V))


def test_kv_bytes_per_token():
    tiny = from_hf_config(tiny_config("deepseek_v2"))
    size = mla_kv_bytes_per_token(tiny, torch.float32)
    # 2 layers; expanded: 4 heads of K 16 + 8 and V 16; latent: 32 + 8; 4 bytes each
    assert (size.expanded, size.latent, size.ratio) == (2 * 4 * 40 * 4, 2 * 40 * 4, 4.0)
    assert ContiguousLatentCache.for_config(tiny, 10).nbytes() == 10 * size.latent
    v2 = from_hf_config(DeepseekV2Config(  # DeepSeek-V2's attention (its MoE aside)
        num_hidden_layers=60, hidden_size=5120, num_attention_heads=128, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=60))
    size = mla_kv_bytes_per_token(v2, torch.bfloat16)
    assert (size.expanded, size.latent) == (60 * 128 * 320 * 2, 60 * 576 * 2)
    assert round(size.ratio, 1) == 71.1
    with pytest.raises(ValueError, match="no latent attention"):
        mla_kv_bytes_per_token(from_hf_config(tiny_config("llama")))


@pytest.mark.parametrize("overrides,message", [
    (dict(first_k_dense_replace=1), "first_k_dense_replace 1 makes layers 1..1 "
                                    "mixture-of-experts"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                            mscale_all_dim=1.0)), "rope scaling 'yarn' is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 differs"),
], ids=["moe", "yarn", "kv_heads"])
def test_what_is_not_implemented_is_refused(tmp_path, overrides, message):
    tiny_config("deepseek_v2", **overrides).save_pretrained(tmp_path)  # config.json alone
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path)


def test_a_per_head_kv_context_is_refused(checkpoints):
    model = load_model(checkpoints["plain"])
    with pytest.raises(TypeError, match="has no attend_latent"):
        model(torch.tensor([1, 2]), torch.arange(2), NoCache())
