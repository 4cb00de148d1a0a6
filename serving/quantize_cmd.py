"""``pagedllm quantize``: write a checkpoint whose linear layers are quantized by GPTQ.

    pagedllm quantize --model smollm2-135m-instruct --scheme fp8 --output smollm2-fp8
    pagedllm generate --model smollm2-fp8 --prompt "..."     # runs the saved fp8 codes

The offline step before serving (llm-compressor's ``oneshot`` before vLLM): calibration on
text the model writes itself, GPTQ against each layer's input Hessian, the folder written
(``reference/engine/quantize.py``). Lesson 18 measures what it buys over rounding at load.
"""

import argparse

from ..reference.model.gptq import GPTQ_SCHEMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a float checkpoint folder, a .gguf file or a model name")
    parser.add_argument("--output", required=True, help="a new folder for the checkpoint")
    parser.add_argument("--scheme", choices=GPTQ_SCHEMES, default="fp8",
                        help="the weights' format, a scale per output channel (default fp8)")
    parser.add_argument("--calibration-samples", type=int, default=32,
                        help="texts the model writes to calibrate on (default 32)")
    parser.add_argument("--calibration-tokens", type=int, default=256,
                        help="tokens per calibration text (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="what the model will compute in: its scales are rounded to it "
                             "(default bfloat16, whose scales float32 holds exactly)")


def run(args: argparse.Namespace) -> int:
    from ..reference.engine.quantize import quantize_checkpoint  # loads the engine

    report = quantize_checkpoint(args.model, args.output, args.scheme,
                                 args.calibration_samples, args.calibration_tokens,
                                 args.seed, args.dtype)
    print(f"{args.output}: {report['layers']} linear layers in {args.scheme}, GPTQ on "
          f"{report['calibration_tokens']} self-written tokens; the layers' output error "
          f"{report['gptq_error'] / report['rtn_error']:.2f}x round to nearest's")
    return 0
