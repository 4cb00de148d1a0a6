"""Train the tiny model that ships with pagedllm, on the CPU, from text Python ships with.

    python training/train_tiny.py                  # about 30 minutes on 2 cores
    python training/train_tiny.py --steps 20 --out /tmp/tiny   # a quick smoke run

A Llama-family decoder with grouped-query attention (8 query heads share 2 KV heads), so the
reference tier, the kernels and the lessons all exercise grouped heads. Trained with
transformers' LlamaForCausalLM (a real, batched training model), saved with save_pretrained
(safetensors, config.json, tokenizer files), loaded by both transformers and the reference tier.
Seeded throughout; training_log.json beside the weights records the corpus, the settings, the
loss curve and the final validation loss.
"""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from corpus import load_corpus  # noqa: E402
from tokenizer import train_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "pagedllm" / "models" / "tiny-pydoc"
SEQ_LEN = 256


def model_config(tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)


def pack(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents, each ended by EOS, cut into rows of SEQ_LEN + 1 tokens."""
    ids = [t for doc in tokenizer(texts)["input_ids"] for t in (*doc, tokenizer.eos_token_id)]
    rows = len(ids) // (SEQ_LEN + 1)
    return torch.tensor(ids[: rows * (SEQ_LEN + 1)]).view(rows, SEQ_LEN + 1)  # [rows, L+1]


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, batch: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        rows = data[i: i + batch]
        logits = model(input_ids=rows[:, :-1]).logits  # [B, L, vocab]
        total += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    model.train()
    return total / count


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.time()

    train_docs, val_docs = load_corpus()
    tokenizer = train_tokenizer(train_docs)
    train_data, val_data = pack(tokenizer, train_docs), pack(tokenizer, val_docs)
    print(f"corpus: {len(train_docs)} training docs -> {train_data.numel():,} tokens, "
          f"{len(val_docs)} validation docs -> {val_data.numel():,} tokens", flush=True)

    model = LlamaForCausalLM(model_config(tokenizer))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    order = torch.Generator().manual_seed(args.seed)
    curve = []
    perm, cursor = torch.randperm(len(train_data), generator=order), 0
    for step in range(args.steps):
        if cursor + args.batch > len(perm):  # a new epoch: reshuffle the rows
            perm, cursor = torch.randperm(len(train_data), generator=order), 0
        rows = train_data[perm[cursor: cursor + args.batch]]  # [B, L+1]
        cursor += args.batch
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup=100)
        logits = model(input_ids=rows[:, :-1]).logits  # [B, L, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        point = {"step": step + 1, "train_loss": round(loss.item(), 4)}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            point["val_loss"] = round(mean_loss(model, val_data), 4)
            print(f"step {step + 1:5d}  train {loss.item():.3f}  val {point['val_loss']:.3f}  "
                  f"{time.time() - start:6.0f}s", flush=True)
        curve.append(point)

    final_train = mean_loss(model, train_data[:len(val_data)])
    final_val = mean_loss(model, val_data)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    log = {
        "python": platform.python_version(), "torch": torch.__version__,
        "corpus": {"sources": ["pydoc_data.topics", "stdlib docstrings (ast)"],
                   "train_docs": len(train_docs), "val_docs": len(val_docs),
                   "train_tokens": train_data.numel(), "val_tokens": val_data.numel()},
        "parameters": params, "seq_len": SEQ_LEN, "batch": args.batch, "steps": args.steps,
        "peak_lr": args.lr, "seed": args.seed, "threads": args.threads,
        "train_seconds": round(time.time() - start, 1),
        "final_train_loss": round(final_train, 4), "final_val_loss": round(final_val, 4),
        "uniform_loss": round(math.log(len(tokenizer)), 4), "curve": curve,
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved {args.out}: {params / 1e6:.2f}M parameters, train loss {final_train:.3f}, "
          f"val loss {final_val:.3f} (uniform guess {math.log(len(tokenizer)):.3f}), "
          f"{log['train_seconds']:.0f}s")


if __name__ == "__main__":
    main()
