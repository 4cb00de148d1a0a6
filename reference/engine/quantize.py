"""Writing a quantized checkpoint: calibrate on the model's own text, GPTQ, save.

``quantize_checkpoint`` is what ``pagedllm quantize`` runs, the offline step llm-compressor's
``oneshot`` is for vLLM:

1. the float model samples ``num_samples`` texts of ``num_tokens`` tokens from its first token
   (temperature 1, a seed each): calibration data without a download;
2. those texts run through it once more, as prompts whose every position is scored (so the LM
   head sees every row, not only the last), while forward hooks add up each linear layer's
   input Hessian (``model/gptq.py:collect_hessians``);
3. every linear layer (a tied LM head is the embedding table and stays float) is quantized by
   GPTQ against its Hessian, with round to nearest's scales;
4. the folder is written (``model/quantized_checkpoint.py``); ``LLM(out_dir)`` serves it.

The calibration runs the reference tier: its layers are the checkpoint's own (the optimized
tier merges q, k and v into one product), so each hook sees one layer's input.
"""

from pathlib import Path

import torch
from tqdm import tqdm

from ..model import load_config, resolve_model
from ..model.gptq import (
    GPTQ_SCHEMES,
    QUANTIZE,
    collect_hessians,
    gptq_quantize,
    output_error,
    quantized_linears,
)
from ..model.quantized_checkpoint import save_quantized
from ..model.weights import load_state_dict
from .config import EngineArgs
from .llm import LLM
from .sampling_params import SamplingParams


# --8<-- [start:calibration]
def calibration_samples(llm: LLM, num_samples: int, num_tokens: int,
                        seed: int = 0) -> list[list[int]]:
    """num_samples token lists of 1 + num_tokens tokens the model writes
    itself, each from one first token (its BOS, else its EOS, else token 0) at
    temperature 1 with a seed of its own: text spread like the model's own, so
    its layers see the inputs they meet in use."""
    tokenizer = llm.tokenizer
    ids = [getattr(tokenizer, name, None) if tokenizer else None
           for name in ("bos_token_id", "eos_token_id")]
    start = [next((i for i in ids if i is not None), 0)]  # BOS, else EOS
    # seeds of their own: another seed gives other texts, not all but one
    params = [SamplingParams(temperature=1.0, max_tokens=num_tokens,
                             ignore_eos=True, seed=seed * num_samples + i)
              for i in range(num_samples)]
    prompts = [{"prompt_token_ids": start}] * num_samples
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [start + list(out.outputs[0].token_ids) for out in outs]
# --8<-- [end:calibration]


def calibration_hessians(llm: LLM, samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """{layer name: H} over every token of samples, read as prompts. A quantized (untied) LM
    head runs on a prompt's last row only in a plain prefill: its Hessian would have one row
    a text, so then every position is scored (prompt_logprobs) and the head sees them all."""
    model = llm.engine.model
    untied = getattr(model, "lm_head", None) in quantized_linears(model).values()
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0 if untied else None)
    prompts = [{"prompt_token_ids": s} for s in samples]
    return collect_hessians(model, lambda: llm.generate(prompts, scored, use_tqdm=False))


def quantize_checkpoint(model: str | Path, out_dir: str | Path, scheme: str = "fp8",
                        num_samples: int = 32, num_tokens: int = 256, seed: int = 0,
                        dtype: str = "bfloat16") -> dict:
    """Write out_dir: model's checkpoint with every linear layer quantized to scheme by GPTQ
    on num_samples self-written texts of num_tokens tokens. dtype: what the model will
    compute in (the scales are rounded to it; bfloat16's are exact in float32 too). Returns
    what it did: {"scheme", "layers", "calibration_tokens", "rtn_error", "gptq_error"}, the
    two errors the layers' output error summed (``gptq.output_error``) by each rounding."""
    if scheme not in GPTQ_SCHEMES:
        raise ValueError(f"scheme {scheme!r}: `pagedllm quantize` writes one of "
                         f"{GPTQ_SCHEMES} (a scale per output channel)")
    for name, value in (("num_samples", num_samples), ("num_tokens", num_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"out_dir {str(out_dir)!r} is not empty; give a new folder (a "
                         "checkpoint is never written over another)")
    # a name or a GGUF file: its float32 conversion, cast to dtype as it loads (the folder
    # benchmarks/weight_quant.py measures, whatever dtype the scales are rounded to)
    model = resolve_model(model)
    config = load_config(model)
    if config.quantization is not None:
        raise ValueError(f"model {str(model)!r} is saved quantized already "
                         f"({config.quantization!r}); give the float checkpoint it came from")
    # the calibration pass reads 1 + num_tokens tokens and samples one more
    positions = config.max_position_embeddings
    if num_tokens + 2 > positions:
        raise ValueError(f"num_tokens {num_tokens}: a calibration text of 1 + num_tokens "
                         f"tokens, and the one token sampled after it, must fit the model's "
                         f"{positions} positions: give at most {positions - 2}")
    llm = LLM(EngineArgs(model, dtype=dtype, enable_prefix_caching=False,
                         max_model_len=num_tokens + 2, max_num_seqs=min(num_samples, 16)))
    try:
        samples = calibration_samples(llm, num_samples, num_tokens, seed)
        hessians = calibration_hessians(llm, samples)
        quantized, rtn_error, gptq_error = {}, 0.0, 0.0
        for name, linear in tqdm(quantized_linears(llm.engine.model).items(), "GPTQ",
                                 unit="layer"):
            try:
                quantized[name] = gptq_quantize(linear.weight, hessians[name], scheme)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            rtn_error += output_error(linear.weight, QUANTIZE[scheme](linear.weight),
                                      hessians[name])
            gptq_error += output_error(linear.weight, quantized[name], hessians[name])
    finally:
        llm.engine.shutdown()
    source = llm.model_dir
    state = {k: t for k, t in load_state_dict(source).items()
             if k.removesuffix(".weight") not in quantized}
    record = {"method": "gptq", "calibration": "self-generated",
              "calibration_samples": num_samples, "calibration_tokens": num_tokens,
              "seed": seed, "dtype": dtype}
    save_quantized(Path(source), out_dir, state, quantized, record)
    return {"scheme": scheme, "layers": len(quantized),
            "calibration_tokens": sum(len(s) for s in samples),
            "rtn_error": rtn_error, "gptq_error": gptq_error}
