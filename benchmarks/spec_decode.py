"""Speculative decoding on the CPU: tokens per second and engine steps per output token, with and
without n-gram proposals (and a draft model), next to transformers' prompt-lookup decoding and
assisted generation on the same prompts. Workloads where proposals can hit (edit a given text;
code that repeats its identifiers) and where they cannot (free chat). One thread; greedy; every
speculative run is checked token for token against plain decoding of the same system.

    python benchmarks/spec_decode.py [--tier optimized] [--max-tokens 128] [--batch 1 8]
                                     [--draft-layers 8 | --draft FOLDER] [--quick]

Rows, per workload and batch size:

- pagedllm plain / ngram / draft: the engine without speculation, with n-gram proposals (vLLM's
  ``{"method": "ngram"}``) and with a draft model (``{"model": ...}``); ratio = tokens per CPU
  second over the engine's plain decoding (one thread: the CPU time is the work, which a busy
  machine's wall clock blurs; tok/s is printed beside it).
- transformers plain / prompt-lookup / assisted (batch 1 only: transformers' prompt lookup and
  assisted generation take one sequence): ``model.generate`` greedy, with
  ``prompt_lookup_num_tokens=k``, and with ``assistant_model=`` the draft; ratio = tokens per
  CPU second over transformers' plain ``generate``.

A draft needs the target's vocabulary. No smaller checkpoint shares SmolLM2-135M's (it is the
smallest of its family) among the installed packages, so ``--draft-layers N`` makes one: the
target's first N decoder layers with its final norm and LM head (an early exit, the draft of
LayerSkip's self-speculation, here untrained for it). Measured: SmolLM2's first 8 of 30 layers
propose the target's token about 1% of the time, so that draft costs more than it saves (in the
engine and in transformers' assisted generation alike); it shows the path works, not that a
draft pays. ``--draft FOLDER`` takes any checkpoint with the target's vocabulary instead.

Ratios are measured side by side in one run (the project's rule for CPU timings); name the CPU
beside them.
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

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
NUM_SPECULATIVE_TOKENS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
         "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def early_exit_draft(folder: Path, num_layers: int, out: Path) -> Path:
    """A draft with the target's vocabulary: its first num_layers decoder layers, then its
    final norm and LM head (every other tensor as it is), in a checkpoint folder of its own."""
    from safetensors.torch import load_file, save_file
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((folder / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}], "
                         f"got {num_layers}")
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            parts = name.split(".")
            layer = int(parts[2]) if parts[:2] == ["model", "layers"] else -1
            if layer < num_layers:
                tensors[name] = tensor.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def run(llm, prompts, params):
    engine = llm.engine
    steps0 = engine.num_steps
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return outs, {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                  "cpu_seconds": cpu, "tok_per_cpu_s": tokens / cpu,
                  "steps_per_token": (engine.num_steps - steps0) / tokens}


def hf_generate(model, ids: list[int], max_tokens: int, **options):
    """transformers' greedy generate on one prompt: (new token ids, measures)."""
    input_ids = torch.tensor([ids])
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=False, temperature=None, top_p=None, top_k=None,
                             max_new_tokens=max_tokens, **options)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    new = out[0, len(ids):].tolist()
    return new, {"tokens": len(new), "seconds": seconds, "tok_per_s": len(new) / seconds,
                 "cpu_seconds": cpu, "tok_per_cpu_s": len(new) / cpu}


def transformers_rows(folder: Path, draft: Path | None, prompt_ids: list[int],
                      max_tokens: int) -> list[dict]:
    """transformers plain, prompt-lookup and (with a draft) assisted generation, one prompt."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_generate(model, prompt_ids, 4)  # warm up
    plain, a = hf_generate(model, prompt_ids, max_tokens)
    ways = {"prompt-lookup": {"prompt_lookup_num_tokens": NUM_SPECULATIVE_TOKENS}}
    if draft is not None:
        assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        # k proposals every step, as the engine's draft makes (not transformers' schedule)
        assistant.generation_config.num_assistant_tokens = NUM_SPECULATIVE_TOKENS
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        ways["assisted"] = {"assistant_model": assistant}
    rows = [{"system": "transformers", "way": "plain", **a, "ratio": 1.0, "same": True}]
    for way, options in ways.items():
        tokens, b = hf_generate(model, prompt_ids, max_tokens, **options)
        rows.append({"system": "transformers", "way": way, **b,
                     "ratio": b["tok_per_cpu_s"] / a["tok_per_cpu_s"], "same": tokens == plain})
    return rows


def engine_rows(plain, speculative: dict, prompts, params) -> list[dict]:
    """The engine plain, then each speculative engine, on the same prompts."""
    plain_outs, a = run(plain, prompts, params)
    rows = [{"system": "pagedllm", "way": "plain", **a, "ratio": 1.0, "same": True}]
    for way, llm in speculative.items():
        before = dict(llm.stats())
        outs, b = run(llm, prompts, params)
        after = llm.stats()
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before[
            "spec_decode_num_accepted_tokens"]
        same = all(x.outputs[0].token_ids == y.outputs[0].token_ids
                   for x, y in zip(plain_outs, outs, strict=True))
        rows.append({"system": "pagedllm", "way": way, **b,
                     "ratio": b["tok_per_cpu_s"] / a["tok_per_cpu_s"],
                     "acceptance_rate": accepted / drafted if drafted else 0.0, "same": same})
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tier", choices=("optimized", "reference"), default="optimized")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft", type=Path, help="a draft checkpoint folder with the target's "
                        "vocabulary")
    drafts.add_argument("--draft-layers", type=int, help="make the draft: the target's first N "
                        "layers, its final norm and LM head")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave out transformers' rows")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 24 tokens, batch 1 (overrides --max-tokens, --batch)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.batch = 24, [1]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.tier == "optimized":
        from pagedllm.optimized import LLM, SamplingParams
    else:
        from pagedllm.reference import LLM, SamplingParams
    from pagedllm.reference.engine.chat import chat_prompt
    from pagedllm.reference.model.registry import resolve_model
    folder = Path(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft
        if args.draft_layers is not None:
            draft = early_exit_draft(folder, args.draft_layers, Path(tmp) / "draft")
        options = dict(max_model_len=1024, num_gpu_blocks=512)
        plain = LLM(str(folder), **options)
        speculative = {"ngram": LLM(str(folder), speculative_config=NGRAM, **options)}
        if draft is not None:
            speculative["draft"] = LLM(str(folder), **options, speculative_config={
                "model": str(draft), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        results = []
        # ratio: tokens per CPU second against the same system's plain decoding (one thread:
        # what a loaded machine's wall clock blurs)
        print(f"{'workload':8} {'batch':>5} {'system':12} {'way':13} {'tok/s':>7} "
              f"{'tok/CPU-s':>9} {'ratio':>6} {'steps/tok':>9} {'accept':>6} same")
        for name in args.workloads:
            prompt = chat_prompt(plain.tokenizer, WORKLOADS[name], None, True)
            for batch in args.batch:
                run(plain, [prompt], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
                rows = engine_rows(plain, speculative, [prompt] * batch, params)
                if batch == 1 and not args.no_transformers:
                    rows += transformers_rows(folder, draft, prompt["prompt_token_ids"],
                                              args.max_tokens)
                for row in rows:
                    row.update(workload=name, batch=batch)
                    steps = row.get("steps_per_token")
                    accept = row.get("acceptance_rate")
                    print(f"{name:8} {batch:5d} {row['system']:12} {row['way']:13} "
                          f"{row['tok_per_s']:7.1f} {row['tok_per_cpu_s']:9.1f} "
                          f"{row['ratio']:6.2f} "
                          f"{'-' if steps is None else f'{steps:.2f}':>9} "
                          f"{'-' if accept is None else f'{accept:.2f}':>6} {row['same']}")
                results += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tier": args.tier, "model": args.model, "threads": 1,
                       "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                       "draft": None if draft is None else str(args.draft or
                                                               f"{args.draft_layers} layers"),
                       "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
