"""Beam search on shared blocks equals transformers' beam search, and frees what it took."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ..conftest import baseline_refusal


@pytest.mark.parametrize("family", ["llama3", "opt", "qwen2"])
@pytest.mark.parametrize("width", [1, 3])
def test_beams_equal_transformers(tier, checkpoints, family, width):
    path = checkpoints[family]
    prompt = list(range(30, 43))
    llm = tier.LLM(path, block_size=4)
    out = llm.beam_search({"prompt_token_ids": prompt}, tier.BeamSearchParams(
        beam_width=width, max_tokens=10, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no end-of-sequence intervenes
    ids = torch.tensor([prompt])
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                       num_beams=width, num_return_sequences=width, do_sample=False,
                       length_penalty=1.0)[:, len(prompt):].tolist()
    assert [s.tokens for s in out.sequences] == want
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and llm.engine.kv.num_seqs == 0  # nothing leaked
    if width > 1:
        assert stats["cow_copies"] > 0  # siblings copied their parent's shared last block


def test_beams_share_blocks_while_they_run(tier, checkpoints):
    """At the deepest point, the beams hold fewer blocks than separate copies would."""
    llm = tier.LLM(checkpoints["llama"], block_size=4)
    kv = llm.engine.kv
    peak = {"held": 0, "unshared": 0}

    def spy(engine, sched, inputs):  # just before each forward: the step's slots are booked
        tables = [kv.get_block_ids(item.seq)[0] for item in sched.scheduled]
        peak["held"] = max(peak["held"], kv.num_total_blocks - kv.num_free_blocks)
        peak["unshared"] = max(peak["unshared"], sum(len(t) for t in tables))

    llm.engine.add_step_observer(spy)
    llm.beam_search({"prompt_token_ids": list(range(40))},
                    tier.BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    assert peak["held"] < peak["unshared"]


def test_bad_beam_requests(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], block_size=4, num_gpu_blocks=20)
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        tier.BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="needs up to"):
        llm.beam_search({"prompt_token_ids": [1, 2, 3]},
                        tier.BeamSearchParams(beam_width=8, max_tokens=40))
    assert llm.stats()["blocks_used"] == 0  # refused before anything was allocated
    ok = llm.beam_search({"prompt_token_ids": [1, 2, 3]},
                         tier.BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))[0]
    assert len(ok.sequences) == 2
    with pytest.raises(ValueError, match=baseline_refusal(tier, "needs kv_layout='paged'")):
        tier.LLM(checkpoints["llama"], kv_layout="contiguous").beam_search(
            {"prompt_token_ids": [1]}, tier.BeamSearchParams(beam_width=2, max_tokens=2))


def test_beams_with_end_of_sequence_equal_transformers_never_stopping_early(tier, tmp_path):
    """A 17-token vocabulary makes end-of-sequence (token 16) common: finished beams compete
    with running ones by length-penalised score. We always run to max_tokens, which is
    transformers' early_stopping="never"."""
    from pagedllm.reference.model.random_checkpoint import tiny_config, write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "v17", tiny_config("llama", vocab_size=17),
                                   seed=0, init_std=0.2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = tier.LLM(path, block_size=4)
    llm.engine.eos_token_id = 16
    finished_some = False
    for seed, penalty in [(0, 1.0), (1, 0.5), (2, 2.0), (3, 1.0)]:
        prompt = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(seed))
        out = llm.beam_search({"prompt_token_ids": prompt.tolist()},
                              tier.BeamSearchParams(beam_width=3, max_tokens=12,
                                                    length_penalty=penalty))[0]
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                           max_new_tokens=12, num_beams=3, num_return_sequences=3,
                           do_sample=False, length_penalty=penalty, early_stopping="never",
                           eos_token_id=16, pad_token_id=16)[:, 6:].tolist()
        want = [w[: w.index(16) + 1] if 16 in w else w for w in want]  # drop the padding
        assert [s.tokens for s in out.sequences] == want
        finished_some |= any(s.finished for s in out.sequences)
    assert finished_some  # end-of-sequence really intervened
    assert llm.stats()["blocks_used"] == 0
