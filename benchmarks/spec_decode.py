"""Speculative decoding on the CPU: tokens per second and engine steps per output token, with and
without n-gram proposals, on workloads where proposals can hit (edit a given text; code that
repeats its identifiers) and where they cannot (free chat). One thread; greedy; every
speculative run is checked token for token against plain decoding.

    python benchmarks/spec_decode.py [--tier optimized] [--max-tokens 128] [--batch 1 8]

Ratios are measured side by side in one run (the project's rule for CPU timings); name the CPU
beside them. Not yet here: the draft-model path on SmolLM2 (no draft with its vocabulary is
installed) and transformers' prompt-lookup / assisted generation on the same prompts.
"""

import argparse
import json
import time

import torch

EDIT_TEXT = ("The KV cache stores the keys and values of every token a sequence has seen, so "
             "that each decode step computes attention for one new token only. PagedAttention "
             "splits that cache into fixed-size blocks, allocated on demand, so that memory is "
             "wasted only in the last block of each sequence.")
CODE = ("def paged_attention(query, key_cache, value_cache, block_table, seq_len, block_size):\n"
        "    keys = []\n    values = []\n    for position in range(seq_len):\n"
        "        block = block_table[position // block_size]\n"
        "        offset = position % block_size\n")
WORKLOADS = {
    "edit": [{"role": "user", "content": "Repeat the following text exactly, correcting any "
                                         "spelling mistakes:\n\n" + EDIT_TEXT}],
    "code": [{"role": "user", "content": "Complete this function; keep the names:\n\n" + CODE}],
    "chat": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def run(llm, prompts, params):
    engine = llm.engine
    steps0 = engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return outs, {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                  "steps_per_token": (engine.num_steps - steps0) / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tier", choices=("optimized", "reference"), default="optimized")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.tier == "optimized":
        from pagedllm.optimized import LLM, SamplingParams
    else:
        from pagedllm.reference import LLM, SamplingParams
    from pagedllm.reference.engine.chat import chat_prompt
    plain = LLM(args.model, max_model_len=1024, num_gpu_blocks=512)
    spec = LLM(args.model, max_model_len=1024, num_gpu_blocks=512, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = []
    print(f"{'workload':8} {'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} "
          f"{'steps/tok plain':>15} {'steps/tok ngram':>15} {'accept':>6} same")
    for name, messages in WORKLOADS.items():
        prompt = chat_prompt(plain.tokenizer, messages, None, True)
        for batch in args.batch:
            prompts = [prompt] * batch
            run(plain, prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
            a_out, a = run(plain, prompts, params)
            before = dict(spec.stats())
            b_out, b = run(spec, prompts, params)
            after = spec.stats()
            drafted = after["spec_decode_num_draft_tokens"] - before[
                "spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before[
                "spec_decode_num_accepted_tokens"]
            same = all(x.outputs[0].token_ids == y.outputs[0].token_ids
                       for x, y in zip(a_out, b_out, strict=True))
            row = {"workload": name, "batch": batch, "plain": a, "ngram": b,
                   "ratio": b["tok_per_s"] / a["tok_per_s"],
                   "acceptance_rate": accepted / drafted if drafted else 0.0, "same": same}
            results.append(row)
            print(f"{name:8} {batch:5d} {a['tok_per_s']:11.1f} {b['tok_per_s']:11.1f} "
                  f"{row['ratio']:6.2f} {a['steps_per_token']:15.2f} "
                  f"{b['steps_per_token']:15.2f} {row['acceptance_rate']:6.2f} {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tier": args.tier, "model": args.model, "threads": 1,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
