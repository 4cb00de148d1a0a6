"""The engine: scheduling never changes a result, memory always comes back, bad input is refused.

Each workload runs the same requests, greedy and seeded-sampled, alone and under every
scheduling regime the engine has; the tokens must be identical. Every test runs once per tier
(the `tier` fixture); transformers and the reference generate loop are the spec it is held to.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm.reference import generate, load_model

from ..conftest import baseline_refusal

PROMPT_LENGTHS = (3, 17, 40, 9, 25, 1, 33, 12, 5, 21, 8, 30, 2, 14, 19, 27)  # 16 requests


def workload(tier, vocab: int = 257):
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
               for n in PROMPT_LENGTHS]
    params = [tier.SamplingParams(temperature=0 if i % 2 == 0 else 0.9,
                                  top_k=-1 if i % 4 else 50, top_p=1.0 if i % 3 else 0.9,
                                  seed=100 + i, max_tokens=8 + (i * 7) % 17, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def run(tier, path, prompts, params, **engine_args):
    llm = tier.LLM(path, **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["blocks_used"] == 0, "memory leaked after the workload"
    if stats["kv_layout"] == "paged":
        manager = llm.engine.kv.manager
        assert manager.num_free_gpu_blocks == manager.gpu.num_blocks and manager.num_seqs == 0
        assert manager.num_free_cpu_blocks == manager.cpu.num_blocks
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def alone(tier, checkpoints):
    """Every request on its own: the answer the batched runs must reproduce."""
    prompts, params = workload(tier)
    return [run(tier, checkpoints["llama3"], [p], [sp])[0][0]
            for p, sp in zip(prompts, params, strict=True)]


REGIMES = {
    "batch of 16": dict(),
    "recompute preemption": dict(num_gpu_blocks=20, block_size=4),
    "swap preemption": dict(num_gpu_blocks=20, block_size=4, preemption_mode="swap",
                            swap_space_blocks=64),
    "chunked prefill, tiny budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=6),
    "chunked prefill + preemption": dict(enable_chunked_prefill=True, max_num_batched_tokens=16,
                                         num_gpu_blocks=20, block_size=4),
    "chunked prefill + swap": dict(enable_chunked_prefill=True, max_num_batched_tokens=8,
                                   num_gpu_blocks=20, block_size=4, preemption_mode="swap",
                                   swap_space_blocks=64),
    "static batches": dict(kv_layout="contiguous", batching="static", max_num_seqs=5),
    "contiguous, pow2 slabs": dict(kv_layout="contiguous", reservation_policy="pow2",
                                   num_gpu_blocks=12, block_size=16),
    "two at a time": dict(max_num_seqs=2),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_scheduling_never_changes_a_result(tier, checkpoints, alone, regime):
    prompts, params = workload(tier)
    if "kv_layout" in REGIMES[regime] and baseline_refusal(tier, "") != "":
        with pytest.raises(ValueError, match=baseline_refusal(tier, "")):
            run(tier, checkpoints["llama3"], prompts, params, **REGIMES[regime])
        return  # a baseline: the reference tier's only
    tokens, stats = run(tier, checkpoints["llama3"], prompts, params, **REGIMES[regime])
    assert tokens == alone
    if "recompute preemption" in regime or "chunked prefill + preemption" in regime:
        assert stats["preemptions_recompute"] > 0  # the small pool really forced preemption
    if "swap" in regime:
        assert stats["preemptions_swap"] > 0 and stats["swap_ins"] == stats["preemptions_swap"]
        assert stats["swapped_blocks"] == 0


def test_engine_greedy_equals_transformers(tier, checkpoints):
    path = checkpoints["qwen2"]
    prompts, _ = workload(tier)
    prompts = prompts[:6]
    params = tier.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours, _ = run(tier, path, prompts, params, num_gpu_blocks=24, block_size=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt["prompt_token_ids"]])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           do_sample=False)[0, ids.shape[1]:].tolist()
        assert got == want


def test_engine_matches_the_single_sequence_loop(tier, checkpoints):
    """Greedy and seeded: the tier's engine sampler and the reference generate loop draw the
    same tokens."""
    path = checkpoints["mistral"]
    model = load_model(path)
    prompt = list(range(5, 30))
    out = tier.LLM(path).generate({"prompt_token_ids": prompt}, tier.SamplingParams(
        temperature=0.7, seed=3, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    want = generate(model, prompt, 20, temperature=0.7,
                    seed=3)
    assert out.outputs[0].token_ids == want


def test_text_prompts_stop_strings_and_finish_reasons(tier):
    from pagedllm.serving.default_model import default_model_dir

    llm = tier.LLM(default_model_dir())
    free = llm.generate("The for statement", tier.SamplingParams(temperature=0, max_tokens=24),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason in ("length", "stop")
    words = free.text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = llm.generate("The for statement", tier.SamplingParams(temperature=0, max_tokens=24,
                                                                stop=[stop]), use_tqdm=False)[0]
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    first = free.token_ids[1]
    by_id = llm.generate("The for statement", tier.SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == free.token_ids[:2] and by_id.stop_reason == first


def test_abort_frees_memory_and_others_keep_running(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], num_gpu_blocks=32, block_size=4)
    engine = llm.engine
    params = tier.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": list(range(10))}, params)
    engine.add_request("b", {"prompt_token_ids": list(range(20, 35))}, params)
    engine.step()
    engine.abort_request("a")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and len(finished[0].outputs[0].token_ids) == 10
    assert llm.stats()["blocks_used"] == 0
    with pytest.raises(ValueError, match="no request with id 'a'"):
        engine.abort_request("a")


@pytest.mark.parametrize("field, kwargs, message", [
    ("n", dict(n=0), "n must be >= 1"),
    ("temperature", dict(temperature=-0.5), "temperature must be >= 0"),
    ("top_p", dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("top_p", dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    ("top_k", dict(top_k=0), "top_k must be -1"),
    ("top_k", dict(top_k=-2), "top_k must be -1"),
    ("max_tokens", dict(max_tokens=0), "max_tokens must be >= 1"),
    ("min_tokens", dict(min_tokens=5, max_tokens=3), "min_tokens must be in"),
])
def test_bad_sampling_params(tier, field, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tier.SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_serving(tier, checkpoints):
    llm = tier.LLM(checkpoints["llama"], num_gpu_blocks=8, block_size=4, max_model_len=64)
    engine = llm.engine
    ok = tier.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("good", {"prompt_token_ids": [1, 2, 3]}, ok)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e1", {"prompt_token_ids": []}, ok)
    with pytest.raises(ValueError, match="longer than max_model_len = 64"):
        engine.add_request("e2", {"prompt_token_ids": [1] * 65}, ok)
    with pytest.raises(ValueError, match="more than the whole KV pool"):
        engine.add_request("e3", {"prompt_token_ids": [1] * 30},
                           tier.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("e4", {"prompt_token_ids": [999]}, ok)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", {"prompt_token_ids": [1]}, ok)
    with pytest.raises(ValueError, match="no request with id 'nope'"):
        engine.abort_request("nope")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and outs[-1].finished
    assert len(outs[-1].outputs[0].token_ids) == 4


def test_bad_engine_arguments(tier, checkpoints):
    path = checkpoints["llama"]
    with pytest.raises(ValueError, match=baseline_refusal(tier, "needs kv_layout='paged'")):
        tier.LLM(path, kv_layout="contiguous", preemption_mode="swap")
    with pytest.raises(ValueError, match=baseline_refusal(tier, "needs kv_layout='contiguous'")):
        tier.LLM(path, batching="static")
    with pytest.raises(ValueError, match="must be >= max_model_len"):
        tier.LLM(path, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="kv_layout 'ring' is unknown"):
        tier.LLM(path, kv_layout="ring")
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        tier.LLM(path, max_model_len=1000)
    llm = tier.LLM(path)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1]}], [tier.SamplingParams(), tier.SamplingParams()])
