"""The shipped tiny model: loads in transformers and in the reference tier, agrees, and learned.

Its training run is recorded in pagedllm/models/tiny-pydoc/training_log.json; the numbers
asserted here were measured on it, with margin.
"""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedllm.reference import NoCache, generate, load_config, load_model
from pagedllm.serving.default_model import default_model_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_model_dir()
VAL_LOSS_BOUND = 4.2  # nats/token: measured 3.99; a uniform guess over 4096 tokens is 8.32


def load_training_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "training" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def test_it_is_small_and_has_grouped_heads():
    cfg = load_config(MODEL)
    assert cfg.model_type == "llama" and cfg.num_kv_heads < cfg.num_heads
    size = sum(f.stat().st_size for f in MODEL.iterdir())
    assert size <= 25 * 2**20, f"the shipped model folder is {size / 2**20:.1f} MiB"


def test_reference_matches_transformers(hf, tokenizer):
    ref = load_model(MODEL)
    ids = torch.tensor(tokenizer("The while statement is used for repeated execution")[
        "input_ids"])
    with torch.no_grad():
        diff = (hf(ids[None]).logits[0] - ref(ids, torch.arange(len(ids)), NoCache())).abs().max()
    assert diff.item() <= 1e-4
    hf.generation_config.eos_token_id = None
    want = hf.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert generate(ref, ids.tolist(), 32) == want


def test_validation_loss_is_far_below_a_uniform_guess(hf, tokenizer):
    corpus = load_training_module("corpus")
    _, val_docs = corpus.load_corpus()
    ids = [t for doc in tokenizer(val_docs)["input_ids"] for t in (*doc, tokenizer.eos_token_id)]
    rows = torch.tensor(ids[: len(ids) // 257 * 257]).view(-1, 257)  # [rows, 257]
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), 32):
            batch = rows[i: i + 32]
            logits = hf(input_ids=batch[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
    val_loss = total / rows[:, 1:].numel()
    uniform = math.log(len(tokenizer))
    log = json.loads((MODEL / "training_log.json").read_text())
    assert abs(val_loss - log["final_val_loss"]) < 0.01  # the corpus rebuilds identically
    assert val_loss < VAL_LOSS_BOUND
    assert uniform - val_loss > 4  # over 4 nats/token better than a uniform guess


def test_chat_template_formats_roles(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is a list?"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nWhat is a list?<|end|>\n<|assistant|>\n"
    assert len(tokenizer(text)["input_ids"]) < len(text) // 2  # specials are single tokens


def test_demo_prints_its_tokens_in_real_words():
    """The demo's work is bounded by tokens (max_tokens per prompt, as it reports), not timed:
    on a loaded machine it is slower, not wrong."""
    corpus = load_training_module("corpus")
    train_docs, _ = corpus.load_corpus()
    known = {w.lower() for doc in train_docs for w in doc.split() if w.isalpha()}
    out = subprocess.run([sys.executable, "-m", "pagedllm", "demo"], capture_output=True,
                         text=True, check=True).stdout
    made = re.search(r"^(\d+) new tokens \((\d+) per prompt\)", out, re.MULTILINE)
    assert made, out
    assert int(made[1]) == out.count(" >>> ") * int(made[2])  # each prompt shown ran its max
    generated, inside = [], False  # continuation text: after " >>> ", and its wrapped lines
    for line in out.splitlines():
        if " >>> " in line:
            inside = True
            generated.append(line.split(" >>> ", 1)[1])
        elif inside and line.startswith("    "):
            generated.append(line)
        else:
            inside = False
    generated = " ".join(generated)
    words = [w.strip(".,;:()'\"") for w in generated.split()]
    alpha = [w for w in words if w.isalpha()]
    assert len(alpha) >= 30
    share_known = sum(w.lower() in known for w in alpha) / len(alpha)
    assert share_known >= 0.8, f"only {share_known:.0%} of the demo's words are real words"
