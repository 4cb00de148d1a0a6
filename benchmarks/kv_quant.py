"""What quantizing the KV cache costs in quality and buys in tokens, per kv_cache_dtype.

For each model and each kv_cache_dtype (auto, fp8_e4m3 with scale 1.0 and with calculated
scales, fp8_e5m2 likewise, int8, int4):

- **perplexity** on ``benchmarks/data/held_text.txt``: 45 documents of Python's own
  documentation (language-reference topics and standard-library docstrings) that the shipped
  tiny model's corpus held out of its training (``training/corpus.py``), so neither model was
  trained on them by us. The text is cut into windows of ``--window`` tokens, each one prefill
  through the engine's quantized paged cache (its queries read every key back dequantized, their
  own included), every next token scored;
- **logit difference and greedy agreement** with ``auto`` over a fixed set of chat prompts: the
  greedy continuation ``auto`` generates is fed back through each cache (teacher forcing), and
  we report the largest |logit difference| over those positions and the share of positions whose
  top token is the same; and how many of the free-running greedy continuations are identical;
- **KV tokens per GiB**, scales included, against a bf16/fp16 cache (what a GPU stores) and a
  float32 one (what this CPU runs).

And the case vLLM only warns about: per-tensor fp8 with scale 1.0 on keys outside e4m3's range
(|k| > 448). SmolLM2's keys stay far below it, so the case is constructed: every layer's k_proj
is multiplied by ``--outlier-gain`` and its q_proj divided by it. Attention scores q · k are
unchanged (rotary is linear), so ``auto`` computes the same model; only the stored keys are large.

    python benchmarks/kv_quant.py --model smollm2-135m-instruct --json /tmp/kv_quant.json
    python benchmarks/kv_quant.py --quick        # the tiny model only, a short text: a minute

Quality is a property of the format, not of the tier (the tiers' tokens agree under every
kv_cache_dtype: tests/engine/test_kv_cache_dtype.py), so this runs the reference tier.
"""

import argparse
import math
from pathlib import Path

import torch

from pagedllm.benchmarks.bench_report import write_json
from pagedllm.benchmarks.progress import progress, say
from pagedllm.reference.engine import EngineArgs, LLMEngine, SamplingParams
from pagedllm.reference.engine.chat import chat_prompt
from pagedllm.reference.engine.step_inputs import StepInputs
from pagedllm.reference.kv_size import kv_size
from pagedllm.reference.model import AttentionMetadata, resolve_model
from pagedllm.reference.model.loader import load_model, load_tokenizer

HELD_TEXT = Path(__file__).parent / "data" / "held_text.txt"
TINY = Path(__file__).resolve().parents[1] / "pagedllm" / "models" / "tiny-pydoc"
# (label, kv_cache_dtype, calculate_kv_scales)
VARIANTS = [("auto", "auto", False), ("fp8_e4m3", "fp8_e4m3", False),
            ("fp8_e4m3 calculated", "fp8_e4m3", True), ("fp8_e5m2", "fp8_e5m2", False),
            ("fp8_e5m2 calculated", "fp8_e5m2", True), ("int8", "int8", False),
            ("int4", "int4", False)]
CHAT_PROMPTS = [
    "What is a Python list comprehension? Answer in two sentences.",
    "Write a haiku about memory.",
    "Explain what a hash table is to a child.",
    "Give three tips for writing clear error messages.",
    "What does the 'del' statement do in Python?",
    "Translate 'good morning, how are you?' into French.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
]
GOALS = {"int8": 0.5, "fp8_e4m3 calculated": 1.0, "int4": 5.0}  # issue 21: perplexity, % over auto


def engine_for(model_dir: Path, model, tokenizer, kv_cache_dtype: str, calculate: bool,
               window: int) -> LLMEngine:
    config = EngineArgs(model_dir, kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate,
                        num_gpu_blocks=-(-window // 16) + 1,
                        max_model_len=min(window, load_config_len(model_dir))
                        ).create_engine_config()
    return LLMEngine(config, model, tokenizer)


def load_config_len(model_dir: Path) -> int:
    from pagedllm.reference.model import load_config

    return load_config(model_dir).max_position_embeddings


@torch.inference_mode()
def window_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """One prefill of ids through the engine's (quantized) paged cache, on blocks 0, 1, ...
    of the idle pool: logits [len(ids), vocab] for every position."""
    T, bs = len(ids), engine.config.block_size
    blocks = torch.arange(-(-T // bs), dtype=torch.int32)
    md = AttentionMetadata(slot_mapping=torch.arange(T), block_tables=blocks[None, :],
                           seq_lens=torch.tensor([T], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                           seq_lens_cpu=torch.tensor([T]), query_start_loc_cpu=torch.tensor([0, T]))
    inputs = StepInputs(input_ids=torch.tensor(ids), positions=torch.arange(T), attn_metadata=md,
                        logits_indices=torch.arange(T), rows=[], sampling=None)
    # [T, vocab]; fp8's scales come from the first window (execute keeps them once it is done)
    return engine.runner.execute(inputs).float()


def perplexity(engine: LLMEngine, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    starts = range(0, len(ids) - 1, window)
    with progress(starts, "perplexity", unit="window") as windows:
        for start in windows:
            chunk = ids[start:start + window + 1]
            if len(chunk) < 2:
                break
            logits = window_logits(engine, chunk[:-1])  # [W, vocab]
            targets = torch.tensor(chunk[1:])
            nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += len(targets)
    return math.exp(nll / count)


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done, made = {}, {}
    with progress(None, "greedy", total=len(prompts) * max_tokens, unit="token") as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                made[out.request_id] = len(out.outputs[0].token_ids)  # so far
                if out.finished:
                    done[int(out.request_id)] = out.outputs[0].token_ids
            bar.update(sum(made.values()) - bar.n)
    return [done[i] for i in range(len(prompts))]


def key_absmax(engine: LLMEngine, ids: list[int]) -> float:
    """The largest |key| the model writes for ids (read back from an auto cache)."""
    window_logits(engine, ids)
    T = len(ids)
    keys = engine.runner.cache_engine.gpu_k  # per layer [num_blocks, block_size, ...]
    return max(float(k.view(-1, *k.shape[2:])[:T].abs().max()) for k in keys)


@torch.no_grad()
def scale_keys(model, gain: float) -> None:
    """k_proj x gain, q_proj / gain in every layer: the same scores, keys `gain` times larger."""
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.k_proj.weight.mul_(gain)
        attn.q_proj.weight.div_(gain)
        for proj, f in ((attn.k_proj, gain), (attn.q_proj, 1 / gain)):
            if proj.bias is not None:
                proj.bias.mul_(f)


def measure_model(name: str, model_dir: Path, window: int, max_text_tokens: int,
                  max_tokens: int, outlier_gain: float, prompts: list[str]) -> dict:
    tokenizer = load_tokenizer(model_dir)
    text = HELD_TEXT.read_text()
    ids = tokenizer.encode(text)[:max_text_tokens]
    model = load_model(model_dir, dtype=torch.float32)
    chats = [chat_prompt(tokenizer, [{"role": "user", "content": p}])["prompt_token_ids"]
             for p in prompts] if tokenizer.chat_template else \
        [tokenizer.encode(p) for p in prompts]
    rows, reference = {}, None
    variants = progress(VARIANTS, f"{name}: kv_cache_dtypes", unit="dtype")
    for label, kv_dtype, calculate in variants:
        variants.set_postfix_str(label)
        engine = engine_for(model_dir, model, tokenizer, kv_dtype, calculate, window)
        ppl = perplexity(engine, ids, window)  # the first window calibrates calculated scales
        outs = greedy(engine, chats, max_tokens)
        if reference is None:  # auto: the continuations every cache is held to
            reference = {"outs": outs, "logits": [window_logits(engine, c + o)[len(c) - 1:-1]
                                                  for c, o in zip(chats, outs, strict=True)]}
        diffs, agree, positions = 0.0, 0, 0
        for c, o, want in progress(zip(chats, reference["outs"], reference["logits"],
                                       strict=True), "logits vs auto", total=len(chats),
                                   unit="prompt"):
            got = window_logits(engine, c + o)[len(c) - 1:-1]  # [len(o), vocab]
            diffs = max(diffs, float((got - want).abs().max()))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            positions += len(o)
        size = kv_size(model_dir, "bfloat16", kv_dtype)
        # The engine's own sizing of a 1 GiB pool (EngineArgs.kv_cache_memory), as a GPU
        # (bf16) and this CPU (float32) would store it.
        in_gib = {dtype: EngineArgs(model_dir, dtype=dtype, kv_cache_dtype=kv_dtype,
                                    kv_cache_memory=2**30).create_engine_config().num_gpu_blocks
                  * 16 for dtype in ("bfloat16", "float32")}
        rows[label] = {
            "kv_cache_dtype": kv_dtype, "calculate_kv_scales": calculate, "perplexity": ppl,
            "max_abs_logit_diff": diffs, "top1_agreement": agree / positions,
            "identical_continuations": sum(
                a == b for a, b in zip(outs, reference["outs"], strict=True)),
            "bytes_per_token": size.bytes_per_token, "tokens_per_gib": size.tokens_per_gib,
            "bytes_per_token_fp32": kv_size(model_dir, "float32", kv_dtype).bytes_per_token,
            "engine_tokens_in_1gib_bf16": in_gib["bfloat16"],
            "engine_tokens_in_1gib_fp32": in_gib["float32"],
        }
        say(f"  {label:22s} ppl {ppl:8.3f}  max|dlogit| {diffs:7.3f}  top-1 "
            f"{agree / positions:6.1%}  tokens/GiB {size.tokens_per_gib:,}")
    auto = rows["auto"]
    for row in rows.values():  # capacities as the engine sized its 1 GiB pools
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / auto["perplexity"] - 1)
        row["capacity_vs_bf16"] = row["engine_tokens_in_1gib_bf16"] / \
            auto["engine_tokens_in_1gib_bf16"]
        row["capacity_vs_fp32"] = row["engine_tokens_in_1gib_fp32"] / \
            auto["engine_tokens_in_1gib_fp32"]

    # The failure case: keys beyond e4m3's range, scale 1.0 against calculated scales.
    probe = engine_for(model_dir, model, tokenizer, "auto", False, window)
    before = key_absmax(probe, ids[:window])
    scale_keys(model, outlier_gain)
    outlier = {"gain": outlier_gain, "key_absmax_before": before,
               "key_absmax_after": key_absmax(probe, ids[:window])}
    # Beside perplexity, how far each cache moves the model on the first window: clipped keys
    # change which tokens attention favours, whether or not the text's perplexity goes up.
    want = None
    outliers = progress((("auto", "auto", False), ("fp8_e4m3", "fp8_e4m3", False),
                         ("fp8_e4m3 calculated", "fp8_e4m3", True), ("int8", "int8", False)),
                        f"{name}: outlier keys", unit="dtype")
    for label, kv_dtype, calculate in outliers:
        outliers.set_postfix_str(label)
        engine = engine_for(model_dir, model, tokenizer, kv_dtype, calculate, window)
        got = window_logits(engine, ids[:window])  # [W, vocab]; calibrates calculated scales
        want = got if want is None else want
        outlier[label] = {"perplexity": perplexity(engine, ids, window),
                          "max_abs_logit_diff": float((got - want).abs().max()),
                          "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float()
                                                  .mean())}
    scale_keys(model, 1 / outlier_gain)
    print(f"  keys x {outlier_gain:g} (|k| max {before:.1f} -> {outlier['key_absmax_after']:.1f}, "
          f"e4m3 max 448): " + ", ".join(
              f"{label} ppl {outlier[label]['perplexity']:.3f} max|dlogit| "
              f"{outlier[label]['max_abs_logit_diff']:.2f} top-1 "
              f"{outlier[label]['top1_agreement']:.1%}"
              for label in ("auto", "fp8_e4m3", "fp8_e4m3 calculated", "int8")))
    return {"model": name, "text_tokens": len(ids), "window": window, "rows": rows,
            "outlier_keys": outlier}


def print_table(result: dict) -> None:
    print(f"\n{result['model']}: perplexity on {result['text_tokens']} tokens of held text "
          f"(windows of {result['window']})")
    print(f"{'kv_cache_dtype':22s} {'ppl':>9s} {'vs auto':>8s} {'max|dlogit|':>11s} "
          f"{'top-1':>7s} {'same':>5s} {'B/token':>8s} {'1 GiB':>9s} {'x bf16':>7s} "
          f"{'x fp32':>7s}")
    for label, r in result["rows"].items():
        goal = GOALS.get(label)
        mark = "" if goal is None else (" ok" if r["perplexity_change_pct"] <= goal else
                                        f" MISSED (goal +{goal}%)")
        print(f"{label:22s} {r['perplexity']:9.3f} {r['perplexity_change_pct']:+7.2f}% "
              f"{r['max_abs_logit_diff']:11.3f} {r['top1_agreement']:7.1%} "
              f"{r['identical_continuations']:5d} {r['bytes_per_token']:8,d} "
              f"{r['engine_tokens_in_1gib_bf16']:9,d} {r['capacity_vs_bf16']:7.2f} "
              f"{r['capacity_vs_fp32']:7.2f}{mark}")
    print("B/token: KV bytes per token in a bf16 model (a GPU's), scales included; 1 GiB: the "
          "tokens the engine's pool holds in 1 GiB (bf16 model); x bf16 / x fp32: tokens in the "
          "same memory as a bf16 / float32 cache; same: free-running greedy continuations "
          "identical to auto's")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", help="a model name or folder (repeatable; "
                   "default: the shipped tiny model)")
    p.add_argument("--quick", action="store_true", help="a short text, 3 prompts")
    p.add_argument("--window", type=int, default=512, help="tokens per scored window")
    p.add_argument("--max-text-tokens", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per chat prompt")
    p.add_argument("--outlier-gain", type=float, default=100.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.window, args.max_text_tokens, args.max_tokens = 128, 384, 12
    prompts = CHAT_PROMPTS[:3] if args.quick else CHAT_PROMPTS
    results = []
    for name in args.model or ["tiny-pydoc"]:
        model_dir = TINY if name == "tiny-pydoc" else Path(resolve_model(name))
        print(f"{name}:", flush=True)
        results.append(measure_model(name, model_dir, args.window, args.max_text_tokens,
                                     args.max_tokens, args.outlier_gain, prompts))
    for result in results:
        print_table(result)
        o = result["outlier_keys"]
        print(f"keys x {o['gain']:g} and queries / {o['gain']:g} (the same model; |k| up to "
              f"{o['key_absmax_after']:.0f}, e4m3's range ends at 448):")
        for label in ("auto", "fp8_e4m3", "fp8_e4m3 calculated", "int8"):
            r = o[label]
            name = "fp8_e4m3 scale 1.0" if label == "fp8_e4m3" else label
            print(f"  {name:22s} ppl {r['perplexity']:9.3f}  max|dlogit| "
                  f"{r['max_abs_logit_diff']:7.3f}  top-1 {r['top1_agreement']:6.1%}")
    out = {"held_text": str(HELD_TEXT.name), "results": results}
    write_json(out, args.json)
    return out


if __name__ == "__main__":
    main()
