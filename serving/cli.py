"""The command line: ``python -m pagedllm`` or ``pagedllm``.

    pagedllm demo                                  # default model, a few prompts, cache vs none
    pagedllm generate --prompt "def main():"       # one completion (default model or --model DIR)
    pagedllm kv-size opt-13b llama-3-8b --tokens 2048
"""

import argparse
import sys
import textwrap
import time
from pathlib import Path

import torch

from pagedllm.reference import generate, load_model
from pagedllm.reference import kv_size as kv_size_cmd
from pagedllm.reference.generate import CACHE_KINDS

from .default_model import default_model_dir

DEMO_PROMPTS = ["The for statement is used to", "Return a list of the", "This module provides"]


def load_tokenizer(model_dir: Path):
    """The checkpoint's own tokenizer through transformers, or None when the folder has none."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def timed_generate(model, prompt_ids, max_tokens: int, cache: str, **kw) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = generate(model, prompt_ids, max_tokens, cache=cache, **kw)
    return out, time.perf_counter() - start


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = default_model_dir()
    print(f"Model: {model_dir}\n  pagedllm's tiny model: a 3.9M-parameter Llama-style decoder "
          "(8 query heads share 2 KV heads)\n  trained on the documentation that ships with "
          "Python. Expect grammatical, odd text.\n")
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    generate(model, tokenizer(DEMO_PROMPTS[0])["input_ids"], 4)  # warm-up, not timed
    totals = {"contiguous": [0, 0.0], "none": [0, 0.0]}
    for prompt in DEMO_PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        # End-of-text is ignored so that both runs do the same amount of work.
        cached, t_cached = timed_generate(model, ids, args.max_tokens, "contiguous")
        plain, t_plain = timed_generate(model, ids, args.max_tokens, "none")
        totals["contiguous"][0] += len(cached)
        totals["contiguous"][1] += t_cached
        totals["none"][0] += len(plain)
        totals["none"][1] += t_plain
        text = " ".join(tokenizer.decode(cached).split())  # one paragraph, whatever it printed
        print(textwrap.fill(f"{prompt} >>> {text}", width=96, subsequent_indent="    "))
        print(f"  with cache {len(cached) / t_cached:7.1f} tok/s | "
              f"without {len(plain) / t_plain:7.1f} tok/s | "
              f"same tokens: {'yes' if cached == plain else 'NO'}\n")
        if cached != plain:
            print("error: cached and uncached generation disagree", file=sys.stderr)
            return 1
    speed = {k: n / t for k, (n, t) in totals.items()}
    print(f"decode speed, {args.max_tokens} new tokens per prompt, on {torch.get_num_threads()} "
          f"CPU threads:")
    print(f"  with KV cache:    {speed['contiguous']:8.1f} tokens/s")
    print(f"  without KV cache: {speed['none']:8.1f} tokens/s (every step recomputes the prefix)")
    print(f"  speed-up:         {speed['contiguous'] / speed['none']:8.1f}x")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else default_model_dir()
    model = load_model(model_dir, dtype=args.dtype)
    tokenizer = load_tokenizer(model_dir)
    if args.prompt_ids is not None:
        ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer files; pass --prompt-ids 1,2,3")
        ids = tokenizer(args.prompt)["input_ids"]
    else:
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3")
    generator = torch.Generator().manual_seed(args.seed)
    eos = None if args.ignore_eos else getattr(tokenizer, "eos_token_id", None)
    out, seconds = timed_generate(model, ids, args.max_tokens, args.cache,
                                  temperature=args.temperature, generator=generator,
                                  eos_token_id=eos)
    print(tokenizer.decode(out) if tokenizer else out)
    print(f"[{len(out)} tokens in {seconds:.2f}s, {len(out) / seconds:.1f} tok/s, "
          f"cache={args.cache}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate on the default model, with and without a cache")
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("--model", help="Hugging Face checkpoint folder (default: the demo model)")
    gen.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    gen.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--cache", choices=CACHE_KINDS, default="contiguous")
    gen.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: as saved)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)

    kv = sub.add_parser("kv-size", help="KV-cache bytes per token for a model or preset")
    kv_size_cmd.add_arguments(kv)
    kv.set_defaults(func=kv_size_cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bars would bury the output
    try:
        return args.func(args)
    except ValueError as err:  # bad input: say what was wrong, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
