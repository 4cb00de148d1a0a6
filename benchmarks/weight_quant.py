"""What quantizing the weights costs in quality and saves in bytes, per scheme.

For each model and each scheme (the checkpoint's weights in float32 and in bfloat16, int8 per
output channel, fp8 (e4m3) per output channel, int4 per group of 32 / 64 / 128 inputs where the
group divides every layer, and for a GGUF model its file's own 4-bit blocks, ``gguf``; fp8 and
int8 again with their codes chosen by GPTQ, ``pagedllm quantize``'s checkpoint, calibrated on
text the model writes itself, never on the held text):

- **perplexity** on ``benchmarks/data/held_text.txt``, the held-out text of the KV-quantization
  benchmark (``kv_quant.py``, whose windowed prefill this reuses), every next token scored;
- **greedy agreement** with the unquantized model at the same dtype (bfloat16, a quantized
  model's own): the share of positions whose top token is the same when the unquantized
  model's greedy continuation of fixed chat prompts is fed back (teacher forcing), and how many
  free-running continuations are identical;
- **weight bytes**, as the engine counts them (``stats()["weight_bytes"]``: codes, scales and
  zero points, the float embedding and norms).

    python benchmarks/weight_quant.py --model smollm2-135m-instruct --json /tmp/wq.json
    python benchmarks/weight_quant.py --quick        # the tiny model, a short text

Quality is a property of the scheme, not of the tier (tests/engine/test_weight_quant.py holds
the tiers together), so this runs the reference tier.
"""

import argparse
import tempfile
from pathlib import Path

import torch

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.kv_quant import (
    CHAT_PROMPTS,
    HELD_TEXT,
    TINY,
    greedy,
    perplexity,
    window_logits,
)
from pagedllm.benchmarks.progress import progress
from pagedllm.reference.engine import EngineArgs, LLMEngine
from pagedllm.reference.engine.chat import chat_prompt
from pagedllm.reference.engine.quantize import quantize_checkpoint
from pagedllm.reference.model import load_config, resolve_model
from pagedllm.reference.model.loader import load_tokenizer

# (label, dtype, quantization, int4's group size or "gptq": a `pagedllm quantize` folder)
SCHEMES = [("float32", "float32", None, None), ("bfloat16", "bfloat16", None, None),
           ("int8", "bfloat16", "int8", None), ("fp8", "bfloat16", "fp8", None),
           ("int4 g32", "bfloat16", "int4", 32),
           ("int4 g64", "bfloat16", "int4", 64), ("int4 g128", "bfloat16", "int4", 128),
           ("gguf", "bfloat16", "gguf", None),
           ("fp8 GPTQ", "bfloat16", "fp8", "gptq"), ("int8 GPTQ", "bfloat16", "int8", "gptq")]
BASELINE = "bfloat16"  # the unquantized model in a quantized model's dtype
# issues 22 and 41, %
GOALS = {"int8": 1.0, "fp8": 1.0, "int4 g32": 6.0, "int4 g64": 6.0, "int4 g128": 6.0,
         "fp8 GPTQ": 1.0, "int8 GPTQ": 1.0}
def gptq_folder(cache: Path, name: str, model_dir: Path, scheme: str, samples: int,
                tokens: int) -> Path:
    """`pagedllm quantize`'s checkpoint of model_dir in cache, written there unless it is
    (a folder per model, scheme and calibration size: --gptq-cache keeps them across runs)."""
    out = cache / f"{name}-{scheme}-s{samples}-t{tokens}"
    if not (out / "config.json").is_file():
        report = quantize_checkpoint(model_dir, out, scheme, samples, tokens)
        print(f"{out}: output error {report['gptq_error'] / report['rtn_error']:.2f}x "
              "round to nearest's", flush=True)
    return out


def engine_for(model_dir: Path, dtype: str, quantization, group_size, window: int):
    args = EngineArgs(model_dir, dtype=dtype, quantization=quantization,
                      quantization_group_size=group_size if isinstance(group_size, int) else 32,
                      num_gpu_blocks=-(-window // 16) + 1,
                      max_model_len=min(window, load_config(model_dir).max_position_embeddings))
    return LLMEngine.from_engine_args(args)


def measure_model(name: str, model_dir: Path, window: int, max_text_tokens: int,
                  max_tokens: int, prompts: list[str], calibration=(32, 256),
                  only=None, gptq_cache: Path | None = None) -> dict:
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(HELD_TEXT.read_text())[:max_text_tokens]
    chats = [chat_prompt(tokenizer, [{"role": "user", "content": p}])["prompt_token_ids"]
             for p in prompts] if tokenizer.chat_template else \
        [tokenizer.encode(p) for p in prompts]
    rows, skipped, base = {}, {}, None
    schemes = progress(SCHEMES, f"{name}: schemes", unit="scheme")
    for label, dtype, scheme, group in schemes:
        if only and label not in only and label != BASELINE:
            continue
        schemes.set_postfix_str(label)
        folder = model_dir
        if group == "gptq":
            folder = gptq_folder(gptq_cache, name, model_dir, scheme, *calibration)
        try:
            engine = engine_for(folder, dtype, scheme, group, window)
        except ValueError as err:  # a group that does not divide a layer; gguf on a folder
            skipped[label] = str(err)
            continue
        ppl = perplexity(engine, ids, window)
        outs = greedy(engine, chats, max_tokens)
        if label == BASELINE:
            base = {"outs": outs, "argmax": [window_logits(engine, c + o)[len(c) - 1:-1]
                                             .argmax(-1) for c, o in zip(chats, outs,
                                                                         strict=True)]}
        agree = positions = 0
        if base is not None:
            for c, o, want in progress(zip(chats, base["outs"], base["argmax"], strict=True),
                                       "top-1 agreement", total=len(chats), unit="prompt"):
                got = window_logits(engine, c + o)[len(c) - 1:-1].argmax(-1)  # [len(o)]
                agree += int((got == want).sum())
                positions += len(o)
        rows[label] = {"perplexity": ppl, "weight_bytes": engine.stats()["weight_bytes"],
                       "top1_agreement": agree / positions if positions else None,
                       "identical_continuations": (sum(a == b for a, b in zip(
                           outs, base["outs"], strict=True)) if base else None),
                       "continuations": len(outs)}
    for row in rows.values():
        row["ppl_change_pct"] = 100 * (row["perplexity"] / rows[BASELINE]["perplexity"] - 1)
        row["bytes_vs_baseline"] = row["weight_bytes"] / rows[BASELINE]["weight_bytes"]
    return {"model": name, "text_tokens": len(ids), "window": window, "schemes": rows,
            "skipped": skipped, "goals_pct": GOALS,
            "gptq_calibration": {"samples": calibration[0], "tokens": calibration[1]}}


def print_table(result: dict) -> None:
    print(f"\n{result['model']}: perplexity on {result['text_tokens']} tokens of held text "
          f"(windows of {result['window']}), against the unquantized model in bfloat16")
    print(f"{'scheme':10s} {'ppl':>9s} {'change':>8s} {'goal':>6s} {'top-1':>7s} "
          f"{'same':>5s} {'weight MB':>10s} {'x bf16':>7s}")
    for label, r in result["schemes"].items():
        goal = GOALS.get(label)
        top1 = "" if r["top1_agreement"] is None else f"{r['top1_agreement']:.1%}"
        same = "" if r["identical_continuations"] is None else \
            f"{r['identical_continuations']}/{r['continuations']}"
        print(f"{label:10s} {r['perplexity']:9.3f} {r['ppl_change_pct']:+7.2f}% "
              f"{'' if goal is None else f'+{goal:g}%':>6s} {top1:>7s} {same:>5s} "
              f"{r['weight_bytes'] / 1e6:10.1f} {r['bytes_vs_baseline']:7.2f}")
    for label, why in result["skipped"].items():
        print(f"{label:10s} skipped: {why}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="a model name or folder (repeatable; "
                   "default: the shipped tiny model)")
    p.add_argument("--quick", action="store_true", help="a short text, 3 prompts")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-text-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per chat prompt")
    p.add_argument("--schemes", help="comma-separated labels to run (default: all; the bf16 "
                   "baseline always runs), e.g. 'fp8,fp8 GPTQ'")
    p.add_argument("--calibration-samples", type=int, default=32, help="GPTQ rows")
    p.add_argument("--calibration-tokens", type=int, default=256, help="GPTQ rows")
    p.add_argument("--gptq-cache", type=Path, default=None, help="a folder to keep the GPTQ "
                   "rows' checkpoints in and reuse (default: written anew, in a temporary "
                   "folder)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.window, args.max_text_tokens, args.max_tokens = 128, 384, 12
        args.calibration_samples, args.calibration_tokens = 4, 32
    prompts = CHAT_PROMPTS[:3] if args.quick else CHAT_PROMPTS
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-gptq-") as tmp:
        for name in args.model or ["tiny-pydoc"]:
            model_dir = TINY if name == "tiny-pydoc" else Path(resolve_model(name))
            print(f"{name}:", flush=True)
            results.append(measure_model(
                name, model_dir, args.window, args.max_text_tokens, args.max_tokens, prompts,
                (args.calibration_samples, args.calibration_tokens),
                args.schemes.split(",") if args.schemes else None,
                args.gptq_cache or Path(tmp)))
    for result in results:
        print_table(result)
    out = {"held_text": str(HELD_TEXT.name), "results": results}
    write_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
