"""The tiny model's loss curve and sample outputs (the appendix "The tiny model").

Reads ``training_log.json`` beside the shipped weights (written by ``training/train_tiny.py``)
and draws the training loss of every step (raw, and smoothed by a running mean), the validation
loss measured every 100 steps, and the loss of a uniform guess over the vocabulary, ln(vocab).
Then it loads the shipped model with the project's own engine and generates from three prompts
in the corpus's domain, greedily and sampled, and renders the chat template for one message.

    .venv/bin/python lessons/figures/tiny_model.py        # about 30 seconds on 2 CPU cores
    .venv/bin/python lessons/figures/tiny_model.py --plot-only   # the loss figure only

It writes tiny_model_loss.png, its Korean edition tiny_model_loss.ko.png (figlang.py) and
tiny_model_samples.json next to itself, and prints the samples.
Greedy outputs are deterministic; the sampled ones are fixed by the seed. Each sample also gets
its longest run of words found word for word in the training text (when this Python is the
version the model was trained on), to show how much the model copies.
"""

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import figlang
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pagedllm.reference.engine.llm import LLM  # noqa: E402
from pagedllm.reference.engine.sampling_params import SamplingParams  # noqa: E402
from pagedllm.serving.default_model import default_model_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAINING = HERE.parents[1] / "training"
PROMPTS = ["The with statement", "Return the number of", "A class definition"]
SMOOTH = 25  # steps in the running mean of the training loss
MAX_TOKENS = 60
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS)
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1, max_tokens=MAX_TOKENS)


def running_mean(values: np.ndarray, width: int) -> np.ndarray:
    """Mean of the last `width` values at each point (fewer at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - width, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def validation(log: dict) -> list[tuple[int, float]]:
    """(step, validation loss) of every evaluation, in step order."""
    evals = [(p["step"], p["val_loss"]) for p in log["curve"] if "val_loss" in p]
    return sorted(dict(evals).items())  # the last step may be logged twice


def best_validation(log: dict) -> dict:
    best_step, best_val = min(validation(log), key=lambda e: e[1])
    return {"best_val_step": best_step, "best_val_loss": best_val}


def plot_loss(log: dict, path: Path, lang: str = "en") -> None:
    T = figlang.chooser(lang)
    curve = log["curve"]
    steps = np.array([p["step"] for p in curve])
    train = np.array([p["train_loss"] for p in curve])
    val_steps, val = zip(*validation(log), strict=True)
    best = best_validation(log)
    best_step, best_val = best["best_val_step"], best["best_val_loss"]
    uniform = log["uniform_loss"]

    fig, ax = plt.subplots(figsize=(8.5, 5.0), dpi=130)
    ax.plot(steps, train, color="tab:blue", alpha=0.18, lw=0.8, label=T("training loss (per step)",
                                                          "학습 손실 (스텝마다)"))
    ax.plot(steps, running_mean(train, SMOOTH), color="tab:blue", lw=2.0,
            label=T(f"training loss ({SMOOTH}-step running mean)",
                    f"학습 손실 ({SMOOTH}스텝 이동 평균)"))
    ax.plot(val_steps, val, "o-", color="tab:orange", lw=1.5, ms=5,
            label=T("validation loss (held-out documents)", "검증 손실 (떼어 둔 문서)"))
    final_train = log["final_train_loss"]
    ax.plot([steps[-1]], [final_train], "D", color="tab:blue", ms=7, mec="black",
            label=T("final training loss (on 25k training tokens)",
                    "최종 학습 손실 (학습 토큰 25k개에서)"))
    ax.axhline(uniform, color="gray", ls="--", lw=1.2)
    guess = f"ln {len_vocab(uniform)} = {uniform:.2f}"
    ax.text(420, uniform + 0.12, T(f"uniform guess: {guess}", f"균등 추측: {guess}"),
            ha="left", va="bottom", color="dimgray", fontsize=10)
    ax.annotate(T(f"lowest validation loss\n{best_val:.2f} at step {best_step}",
                  f"가장 낮은 검증 손실\n스텝 {best_step}에서 {best_val:.2f}"),
                xy=(best_step, best_val), xytext=(best_step - 150, best_val + 1.5),
                ha="center", fontsize=10, color="tab:orange",
                arrowprops=dict(arrowstyle="->", color="tab:orange"))
    ax.annotate(T(f"final: validation {val[-1]:.2f}\ntraining {final_train:.2f}",
                  f"최종: 검증 {val[-1]:.2f}\n학습 {final_train:.2f}"),
                xy=(steps[-1], val[-1]), xytext=(steps[-1] - 10, val[-1] + 1.1), ha="right",
                fontsize=10, arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_xlabel(T("training step (16 rows × 256 tokens each)",
                    "학습 스텝 (스텝마다 16행 × 256토큰)"))
    ax.set_ylabel(T("cross-entropy loss (nats per token)", "교차 엔트로피 손실 (토큰당 nat)"))
    params, minutes = f"{log['parameters'] / 1e6:.2f}M", f"{log['train_seconds'] / 60:.0f}"
    ax.set_title(T(f"tiny-pydoc: {params} parameters, {log['steps']} steps, "
                   f"{minutes} min on {log['threads']} CPU threads",
                   f"tiny-pydoc: 파라미터 {params}, {log['steps']} 스텝, "
                   f"CPU 스레드 {log['threads']}개로 {minutes}분"))
    ax.set_xlim(0, steps[-1] + 20)
    ax.set_ylim(0, math.ceil(max(train.max(), uniform)) + 0.3)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def len_vocab(uniform: float) -> int:
    return round(math.exp(uniform))


def samples(model_dir: Path) -> dict:
    llm = LLM(model_dir)
    out = {"prompts": PROMPTS}
    for name, kwargs in (("greedy", GREEDY), ("sampled", SAMPLED)):
        results = llm.generate(PROMPTS, SamplingParams(**kwargs), use_tqdm=False)
        out[name] = {"sampling_params": kwargs,
                     "outputs": [{"prompt": p, "text": r.outputs[0].text,
                                  "tokens": len(r.outputs[0].token_ids),
                                  "finish_reason": r.outputs[0].finish_reason}
                                 for p, r in zip(PROMPTS, results, strict=True)]}
    messages = [{"role": "user", "content": "What does the with statement do?"}]
    out["chat_template"] = {
        "messages": messages,
        "rendered": llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True),
    }
    return out


def longest_verbatim_run(text: str, corpus_text: str) -> str:
    """The longest run of whole words of `text` that appears word for word in `corpus_text`."""
    words, best = text.split(), ""
    for i in range(len(words)):
        for j in range(len(words), i + len(best.split()), -1):
            run = " ".join(words[i:j])
            if run in corpus_text:
                best = run
                break
    return best


def mark_memorised(result: dict, python_version: str) -> None:
    """Add to each sample its longest word-for-word run from the training text.

    Only when this Python is the one the model was trained on: another version's documentation
    is a different corpus (training/corpus.py reads it from the running interpreter).
    """
    if platform.python_version() != python_version:
        result["verbatim_check"] = f"skipped: Python {platform.python_version()}, " \
                                   f"the model was trained on {python_version}"
        return
    sys.path.insert(0, str(TRAINING))
    from corpus import load_corpus

    train_docs, _ = load_corpus()
    corpus_text = " ".join(" ".join(train_docs).split())  # whitespace runs -> one space
    for name in ("greedy", "sampled"):
        for o in result[name]["outputs"]:
            run = longest_verbatim_run(o["prompt"] + o["text"], corpus_text)
            o["longest_verbatim_run"] = {"words": len(run.split()), "text": run}
    result["verbatim_check"] = "longest_verbatim_run: the longest run of words of prompt + " \
                               "text found word for word in the training documents"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot-only", action="store_true",
                        help="draw the loss figure (both editions) only, generating nothing")
    args = parser.parse_args(argv)
    model_dir = default_model_dir()
    log = json.loads((model_dir / "training_log.json").read_text())
    figlang.draw_both(plot_loss, HERE / "tiny_model_loss.png", log)
    if args.plot_only:
        return
    summary = best_validation(log)
    result = {"model": model_dir.name, **summary, **samples(model_dir)}
    mark_memorised(result, log["python"])
    (HERE / "tiny_model_samples.json").write_text(json.dumps(result, indent=1,
                                                             ensure_ascii=False) + "\n")
    print(f"lowest validation loss {summary['best_val_loss']} at step {summary['best_val_step']}")
    for name in ("greedy", "sampled"):
        print(f"\n== {name} ==")
        for o in result[name]["outputs"]:
            run = o.get("longest_verbatim_run", {}).get("text")
            print(f"{o['prompt']!r} -> {o['text']!r}\n    {o['tokens']} tokens, "
                  f"{o['finish_reason']}; longest run from the training text: {run!r}")
    print("\n== chat template ==\n" + result["chat_template"]["rendered"])


if __name__ == "__main__":
    main()
