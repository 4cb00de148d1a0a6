"""What structured outputs cost the engine's steps: compiling a new grammar, and the masks.

A batch of plain requests decodes (greedy, EOS ignored). Interleaved, trial after trial, one
decode step of the batch is timed three ways:

    step alone                    nothing else happens
    step, compile on the thread   a new JSON schema was just handed to the compiler's thread
                                  (what add_request does): xgrammar compiles it during the step
    compile inline + step         the same compile on the engine thread first, then the step
                                  (what add_request would cost if it compiled there)

and the engine thread's CPU time (``thread_time``, one torch thread) and the wall-clock time of
each are reported as medians in milliseconds. The CPU time says how much work the engine
thread itself does; the wall time adds whatever the compiler's thread takes from it on a
machine with no free core. Also: the first structured output's add_request (the compiler's
thread builds the vocabulary's table), a cached spec at the door (xgrammar parses it, the
cache finds it), and the batch's decode step with batch // 2 more rows, plain, against the
same rows under a grammar (each grammar row fills its bitmask row on the CPU, and the
sampler masks the logits).

    python benchmarks/structured_outputs_step.py                        # the tiny model
    python benchmarks/structured_outputs_step.py --model smollm2-135m-instruct --trials 8
"""

import argparse
import json
import statistics
import time

import torch

from pagedllm import optimized, reference
from pagedllm.benchmarks.progress import progress
from pagedllm.reference.engine.structured_outputs import StructuredOutputsParams
from pagedllm.serving.default_model import default_model_dir

TIERS = {"reference": reference, "optimized": optimized}


def schema(i: int) -> dict:
    """A schema of a typical size, different for every i (a new one compiles)."""
    return {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10 + i},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"]}},
        "required": ["name", "age", "tags", "address"]}


def timed(fn) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of fn()."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def measure(tier_name: str, model, batch: int, trials: int, steps: int) -> dict:
    tier = TIERS[tier_name]
    llm = tier.LLM(model, seed=0, max_num_seqs=batch + batch // 2 + 1)
    engine = llm.engine
    prompt = {"prompt_token_ids": engine.tokenizer("The with statement")["input_ids"]}
    plain = tier.SamplingParams(temperature=0.0, max_tokens=3 * trials + 2 * steps + 16,
                                ignore_eos=True)
    plain_ids = [f"b{i}" for i in range(batch)]
    for request_id in plain_ids:
        engine.add_request(request_id, prompt, plain)
    engine.step()  # the prefills
    first = tier.SamplingParams(max_tokens=1,
                                structured_outputs=StructuredOutputsParams(json=schema(-1)))
    first_ms, _ = timed(lambda: engine.add_request("first", prompt, first))
    while engine.has_request("first"):
        engine.step()
    compiler = engine.grammars.compiler  # the engine's, built by the first grammar
    cached_ms, _ = timed(lambda: compiler.lookup(StructuredOutputsParams(json=schema(-1))))

    ways = {"step alone": [], "step, compile on the thread": [], "compile inline + step": []}
    for t in progress(range(trials), f"{tier_name}: trials", unit="trial"):
        ways["step alone"].append(timed(engine.step))
        spec = StructuredOutputsParams(json=schema(1000 + t))
        pending = []
        ways["step, compile on the thread"].append(
            timed(lambda s=spec, p=pending: (p.append(compiler.submit(s)), engine.step())))
        pending[0].result()
        spec = StructuredOutputsParams(json=schema(2000 + t))
        ways["compile inline + step"].append(
            timed(lambda s=spec: (compiler.cache.get(s), engine.step())))

    def decode_ms(params) -> float:
        """The batch with batch // 2 more requests of these params: median step CPU ms."""
        extra = [f"x{i}" for i in range(batch // 2)]
        for request_id in extra:
            engine.add_request(request_id, prompt, params)
        engine.step()  # their prefills (after the grammar's lookup: it is cached)
        cpu = statistics.median(timed(engine.step)[1] for _ in range(steps))
        for request_id in extra:
            if engine.has_request(request_id):
                engine.abort_request(request_id)
        return cpu

    # an array of integers: a grammar no greedy row finishes within the steps
    spec = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    compiler.cache.get(spec)
    rows_plain = decode_ms(tier.SamplingParams(temperature=0.0, max_tokens=steps + 2,
                                               ignore_eos=True))
    rows_grammar = decode_ms(tier.SamplingParams(temperature=0.0, max_tokens=steps + 2,
                                                 structured_outputs=spec))
    for request_id in plain_ids:  # every other request has finished or was aborted
        if engine.has_request(request_id):
            engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()
    engine.shutdown()
    out = {"tier": tier_name, "vocab": engine.vocab_size, "batch": batch,
           "first_structured_add_ms": first_ms, "cached spec (parse + lookup)_ms": cached_ms,
           "decode, extra rows plain: cpu_ms": rows_plain,
           "decode, extra rows with a grammar: cpu_ms": rows_grammar}
    for way, pairs in ways.items():
        out[f"{way}: wall_ms"] = statistics.median(w for w, _ in pairs)
        out[f"{way}: cpu_ms"] = statistics.median(c for _, c in pairs)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--tiers", default="reference,optimized")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(t, args.model, args.batch, args.trials, args.steps)
            for t in args.tiers.split(",")]
    for row in rows:
        print(f"{row['tier']} (vocab {row['vocab']}, {row['batch']} requests decoding):")
        for key, value in row.items():
            if key.endswith("_ms"):
                print(f"  {key:40s} {value:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
