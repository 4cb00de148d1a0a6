"""The seam between scheduling and model execution (vLLM V1's shape).

- the subpackages import one way: ops and model never import engine or kv; kv never imports
  model or engine; sim never imports model or engine;
- the engine's forward runs the backend's ops: a counting backend sees every one called;
- one step's inputs are consistent tensors (slot mapping through the block tables, offsets,
  logits rows);
- output text is detokenized incrementally and equals decoding the whole output;
- stop strings are found across token boundaries and only after min_tokens;
- beam search is an engine request: batched with others, preempted by recompute or swap, same
  beams.
"""

import ast
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedllm.reference import LLM, BeamSearchParams, SamplingParams
from pagedllm.reference.engine.detokenizer import IncrementalDetokenizer
from pagedllm.reference.engine.sequence import Sequence
from pagedllm.reference.engine.stop import check_stop
from pagedllm.reference.ops import REFERENCE_BACKEND, Backend
from pagedllm.serving.default_model import default_model_dir

REFERENCE = Path(__file__).resolve().parents[2] / "reference"
SUBPACKAGES = ("ops", "model", "kv", "engine", "sim")
FORBIDDEN = {"ops": {"model", "kv", "engine", "sim"}, "model": {"kv", "engine", "sim"},
             "kv": {"model", "engine", "sim"}, "sim": {"model", "engine"}, "engine": set()}


def project_imports(path: Path, package: str) -> set[str]:
    """The reference subpackages a module imports (relative or absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[:2] == ["pagedllm", "reference"] and len(parts) > 2:
                    found.add(parts[2])
                continue
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 1:  # from .x: its own package
                found.add(package)
            elif node.level == 2 and parts:  # from ..x: a sibling subpackage or module
                found.add(parts[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["pagedllm", "reference"] and len(parts) > 2:
                    found.add(parts[2])
    return found


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_imports_go_one_way(package):
    modules = sorted((REFERENCE / package).glob("*.py"))
    assert modules, f"reference/{package} has no modules"
    for path in modules:
        bad = project_imports(path, package) & FORBIDDEN[package]
        assert not bad, f"reference/{package}/{path.name} imports {sorted(bad)}"
    assert (REFERENCE / package / "__init__.py").read_text().startswith('"""')


def counting_backend() -> tuple[Backend, Counter]:
    calls = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    ops = ("store_kv", "paged_attention", "copy_blocks", "swap_blocks", "rms_norm", "rotary",
           "silu_and_mul", "sample")
    return replace(REFERENCE_BACKEND, **{op: counted(op, getattr(REFERENCE_BACKEND, op))
                                         for op in ops}), calls


def test_the_forward_runs_the_backends_ops(checkpoints):
    backend, calls = counting_backend()
    llm = LLM(checkpoints["llama3"], block_size=4, num_gpu_blocks=14, backend=backend,
              preemption_mode="swap", swap_space_blocks=40)
    reference = LLM(checkpoints["llama3"], block_size=4, num_gpu_blocks=14,
                    preemption_mode="swap", swap_space_blocks=40)
    prompts = [{"prompt_token_ids": list(range(3 + i, 13 + 2 * i))} for i in range(4)]
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    layers = llm.engine.model.config.num_layers
    assert calls["store_kv"] == calls["paged_attention"] > 0
    assert calls["store_kv"] % layers == 0
    for op in ("rms_norm", "rotary", "silu_and_mul", "sample", "copy_blocks", "swap_blocks"):
        assert calls[op] > 0, f"{op} never ran"
    assert llm.stats()["preemptions_swap"] > 0 and llm.stats()["cow_copies"] > 0
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in want]


def test_one_mixed_step_has_consistent_inputs(checkpoints):
    """Chunked prefill mixes a decode, a chunk and a whole prompt in one step."""
    llm = LLM(checkpoints["llama"], block_size=4, enable_chunked_prefill=True,
              max_num_batched_tokens=12)
    seen = []

    def observe(engine, sched, inputs):  # the sequences move on after the step: copy now
        samples = [item.samples for item in sched.scheduled]
        seen.append((sched, inputs, samples))

    llm.engine.add_step_observer(observe)
    llm.generate([{"prompt_token_ids": list(range(1, 4))},
                  {"prompt_token_ids": list(range(10, 30))}],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    mixed = [s for s, _, _ in seen if {item.num_tokens for item in s.scheduled} - {1}
             and 1 in {item.num_tokens for item in s.scheduled}]
    assert mixed, "no step mixed a decode with a prefill chunk"
    for sched, inputs, samples in seen:
        md = inputs.attn_metadata
        qsl, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        assert qsl[0] == 0 and qsl[-1] == inputs.input_ids.numel() == md.slot_mapping.numel()
        assert md.block_tables.dtype == torch.int32 and md.query_start_loc.dtype == torch.int32
        bs = llm.engine.kv.block_size
        for b, item in enumerate(sched.scheduled):
            rows = range(qsl[b], qsl[b + 1])
            assert len(rows) == item.num_tokens
            positions = inputs.positions[qsl[b]:qsl[b + 1]].tolist()
            assert positions[-1] == lens[b] - 1  # the queries are the sequence's last tokens
            table = md.block_tables[b].tolist()
            want = [table[p // bs] * bs + p % bs for p in positions]
            assert md.slot_mapping[qsl[b]:qsl[b + 1]].tolist() == want
        ends = {qsl[b + 1] - 1 for b in range(len(sched.scheduled)) if samples[b]}
        assert set(inputs.logits_indices.tolist()) == ends
        assert inputs.sampling.temperature.numel() == inputs.logits_indices.numel()


def test_incremental_detokenization_equals_decoding_the_whole_output():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # random ids split UTF-8 characters across tokens
        ids = torch.randint(0, tokenizer.vocab_size, (int(torch.randint(1, 30, (1,),
                                                                        generator=g)),),
                            generator=g).tolist()
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def grow(text_pieces, params, eos=None):
    """Feed a sequence text piece by piece as if each were one token's text; return it."""
    seq = Sequence(0, [1, 2])
    for i, piece in enumerate(text_pieces):
        seq.output_token_ids.append(100 + i)
        seq.output_text += piece
        check_stop(seq, piece, params, eos, max_model_len=1000)
        if seq.is_finished:
            break
    return seq


def test_stop_strings_span_tokens_and_wait_for_min_tokens():
    params = SamplingParams(max_tokens=20, stop=["STOP"])
    seq = grow(["ab", "ST", "O", "Pxy", "z"], params)
    assert (seq.finish_reason, seq.stop_reason, seq.output_text) == ("stop", "STOP", "ab")
    # the first two tokens' text cannot end the request, nor be cut away later
    early = grow(["STOP", "..", "more", "STOP!"], replace(params, min_tokens=2))
    assert early.stop_reason == "STOP" and early.output_text == "STOP..more"
    assert len(early.output_token_ids) == 4
    # a stop string spanning the min_tokens boundary is not searched before it
    boundary = grow(["xST", "OP", "y"], replace(params, min_tokens=1))
    assert boundary.finish_reason == "length" or boundary.output_text == "xSTOPy"
    assert grow(["a"] * 20, params).finish_reason == "length"
    eos = grow(["a", "b"], SamplingParams(max_tokens=5), eos=101)
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)


@pytest.mark.parametrize("regime", [
    dict(num_gpu_blocks=16, preemption_mode="recompute"),
    dict(num_gpu_blocks=16, preemption_mode="swap", swap_space_blocks=64),
    dict(num_gpu_blocks=16, enable_chunked_prefill=True, max_num_batched_tokens=8),
])
def test_beam_search_runs_through_the_scheduler(checkpoints, regime):
    """Beam searches batched with each other and with sampled requests, in a pool small enough
    to preempt them: the same beams as alone in a roomy pool, nothing leaked."""
    path = checkpoints["llama"]
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + i))} for i in range(3)]
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    alone = [LLM(path, block_size=4).beam_search(p, params)[0] for p in prompts]
    llm = LLM(path, block_size=4, **regime)
    for i in range(3):  # sampled requests compete for the pool in the same steps
        llm.engine.add_request(f"other{i}", {"prompt_token_ids": list(range(40, 52))},
                               SamplingParams(max_tokens=12, seed=i, ignore_eos=True))
    together = llm.beam_search(prompts, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for a, b in zip(alone, together, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences])
    stats = llm.stats()
    assert stats["blocks_used"] == 0 and llm.engine.kv.num_seqs == 0
    if "preemption_mode" in regime:
        assert stats[f"preemptions_{regime['preemption_mode']}"] > 0
