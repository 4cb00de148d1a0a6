"""The command line: ``python -m pagedllm`` or ``pagedllm``.

    pagedllm demo                                  # the tiny model: engine, cache vs none
    pagedllm generate --prompt "The for statement" # completions (tiny model or --model DIR)
    pagedllm chat                                  # talk to SmolLM2-135M-Instruct
    pagedllm generate --model smollm2-135m-instruct --chat "What is a KV cache?"
    pagedllm kv-size opt-13b llama-3-8b --tokens 2048
    pagedllm serve                                 # an OpenAI-compatible server on :8000
    pagedllm serve --model smollm2-135m-instruct --max-num-seqs 32
"""

import argparse
import sys
import textwrap
import time

import torch

from pagedllm.optimized import LLM as OptimizedLLM
from pagedllm.reference import generate
from pagedllm.reference import kv_size as kv_size_cmd
from pagedllm.reference.engine.chat import chat_prompt, chat_template_of
from pagedllm.reference.engine.config import KV_LAYOUTS
from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.reference.model import load_model

from . import env_cmd, quantize_cmd
from .args import DTYPE_HELP, add_kv_cache_arguments, add_serve_arguments
from .default_model import default_model_dir

DEMO_PROMPTS = ["The for statement is used to", "Return a list of the", "This module provides"]
CHAT_MODEL = "smollm2-135m-instruct"  # the real chat model (reference/model/registry.py)


def timed_generate(model, prompt_ids, max_tokens: int, cache: str, **kw) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = generate(model, prompt_ids, max_tokens, cache=cache, **kw)
    return out, time.perf_counter() - start


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = default_model_dir()
    print(f"Model: {model_dir}\n  pagedllm's tiny model: a 3.9M-parameter Llama-style decoder "
          "(8 query heads share 2 KV heads)\n  trained on the documentation that ships with "
          "Python. Expect grammatical, odd text.\n")
    # One thread: a 3.9M-parameter model's products are too small to split across cores, and
    # a second thread waiting for a busy core stalls every small operator.
    torch.set_num_threads(1)
    llm = OptimizedLLM(model_dir)  # the fast tier: the reference's tokens, vectorized attention
    # End-of-text is ignored so that every run below does the same amount of work.
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(DEMO_PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
    engine_seconds = time.perf_counter() - start
    for out in outs:
        text = " ".join(out.outputs[0].text.split())  # one paragraph, whatever it printed
        print(textwrap.fill(f"{out.prompt} >>> {text}", width=96, subsequent_indent="    "))
    print()

    # The same prompts one at a time through the plain generate loop, with and without a cache.
    model, n_tokens = load_model(model_dir), 0  # the plain reference model
    seconds = {"contiguous": 0.0, "none": 0.0}
    for out in outs:
        expected = out.outputs[0].token_ids
        for cache in seconds:
            tokens, spent = timed_generate(model, out.prompt_token_ids, args.max_tokens, cache)
            seconds[cache] += spent
            if tokens != expected:
                print(f"error: generation with cache={cache} disagrees with the engine",
                      file=sys.stderr)
                return 1
        n_tokens += len(expected)
    print(f"{n_tokens} new tokens ({args.max_tokens} per prompt), same tokens every way, "
          f"on {torch.get_num_threads()} CPU threads:")
    print(f"  engine, paged KV, {len(outs)} prompts batched: {n_tokens / engine_seconds:8.1f} "
          "tokens/s (optimized tier)")
    print(f"  one at a time, with KV cache:      {n_tokens / seconds['contiguous']:8.1f} tokens/s")
    print(f"  one at a time, without KV cache:   {n_tokens / seconds['none']:8.1f} tokens/s "
          "(every step recomputes the prefix)")
    print(f"  speed-up of the KV cache:          {seconds['none'] / seconds['contiguous']:8.1f}x")
    print(f"\nA real chat model (SmolLM2-135M-Instruct, installed from the package registry and "
          f"converted once):\n  pagedllm chat --model {CHAT_MODEL}")
    return 0


def _prompts(args: argparse.Namespace) -> list:
    if args.prompt_ids is not None and args.prompt is not None:
        raise ValueError("give either --prompt or --prompt-ids, not both")
    if args.prompt_ids is not None:
        pieces = [t.strip() for t in args.prompt_ids.split(",") if t.strip()]
        if not pieces:
            raise ValueError("--prompt-ids is empty; give comma-separated token ids, e.g. 1,2,3")
        ids = []
        for piece in pieces:
            try:
                ids.append(int(piece))
            except ValueError:
                raise ValueError(f"--prompt-ids must be comma-separated integers, e.g. 1,2,3; "
                                 f"{piece!r} is not one") from None
        return [{"prompt_token_ids": ids}]
    if not args.prompt:
        raise ValueError("give --prompt TEXT (repeatable) or --prompt-ids 1,2,3")
    for i, text in enumerate(args.prompt, 1):
        if not text:
            raise ValueError(f"--prompt number {i} is empty; give some text to complete")
    return args.prompt


def _flagged(err: ValueError, args: argparse.Namespace) -> ValueError:
    """The engine's refusal as the user typed it. The field it is about (``err.field``, as the
    server's 400 names it) is this command's flag when the command has one of that name: the
    message's leading field name becomes the flag (max_tokens -> --max-tokens). An error of no
    field, or of a field no flag of the command sets, is told as it is."""
    field = getattr(err, "field", None)
    message = str(err)
    if field is None or not hasattr(args, field) or not message.startswith(field + " "):
        return err
    return ValueError("--" + field.replace("_", "-") + message[len(field):])


def cmd_generate(args: argparse.Namespace) -> int:
    model_dir = args.model if args.model is not None else default_model_dir()
    if args.chat is not None and (args.prompt or args.prompt_ids):
        raise ValueError("give either --chat TEXT or --prompt/--prompt-ids, not both")
    prompts = None if args.chat is not None else _prompts(args)
    try:  # the sampling flags first: a typo there should not wait for the model to load
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        llm = LLM(model_dir, dtype=args.dtype, kv_layout=args.kv_layout,
                  block_size=args.block_size, preemption_mode=args.preemption_mode,
                  seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
                  calculate_kv_scales=args.calculate_kv_scales,
                  quantization=args.quantization,
                  quantization_group_size=args.quantization_group_size,
                  quantization_skip=tuple(args.quantization_skip),
                  tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size,
                  speculative_config=args.speculative_config)
    except ValueError as err:
        raise _flagged(err, args) from err
    if args.chat is not None:  # one user message through the checkpoint's chat template
        if not args.chat.strip():
            raise ValueError("--chat is empty; give a question or an instruction")
        prompts = [chat_prompt(llm.tokenizer, [{"role": "user", "content": args.chat}])]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    for out in outs:
        completion = out.outputs[0]
        print(completion.text if llm.tokenizer else completion.token_ids)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"[{n} tokens in {seconds:.2f}s, {n / seconds:.1f} tok/s, kv_layout={args.kv_layout}, "
          f"finish: {', '.join(o.outputs[0].finish_reason for o in outs)}]", file=sys.stderr)
    return 0


def stream(llm: LLM, prompt: dict, params: SamplingParams):
    """Yield the text of one request as the engine produces it, step by step."""
    request_id = f"chat-{time.monotonic_ns()}"
    llm.engine.add_request(request_id, prompt, params)
    shown = 0
    try:
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.request_id == request_id:
                    text = out.outputs[0].text
                    yield text[shown:]
                    shown = len(text)
    finally:  # Ctrl-C mid-answer: the request leaves the engine, its blocks freed
        if llm.engine.has_request(request_id):
            llm.engine.abort_request(request_id)


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line typed is a user message; the answer streams
    back as the engine produces it; the conversation so far is the next prompt."""
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens)
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True)
    except ValueError as err:
        raise _flagged(err, args) from err
    chat_template_of(llm.tokenizer)  # a model without one is refused before the first line
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {args.model} (Ctrl-D or /exit to leave).", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, like Ctrl-D
            print(file=sys.stderr)
            return 0
        if not line or line.strip() == "/exit":
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        answer = ""
        try:
            for piece in stream(llm, chat_prompt(llm.tokenizer, messages), params):
                print(piece, end="", flush=True)
                answer += piece
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the conversation
            print(" [stopped]", end="")
        except ValueError as err:  # e.g. the conversation outgrew max_model_len
            messages.pop()  # the conversation goes on without the message that did not fit
            print(f"error: {' '.join(str(err).split())}; that message was dropped (a shorter "
                  "one, or a new conversation, will fit)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": answer})


def cmd_serve(args: argparse.Namespace) -> int:
    from .launch import serve  # FastAPI and uvicorn load only for this command

    try:
        return serve(args)
    except ValueError as err:
        raise _flagged(err, args) from err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate on the default model, with and without a cache")
    demo.add_argument("--max-tokens", type=int, default=128)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="complete prompts with the engine")
    gen.add_argument("--model", help="a checkpoint folder, a .gguf file or a model name such as "
                     f"{CHAT_MODEL} (default: the tiny model)")
    gen.add_argument("--prompt", action="append", help="text (repeat for a batch)")
    gen.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    gen.add_argument("--chat", help="one user message, through the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--kv-layout", choices=KV_LAYOUTS, default="paged")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    gen.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    gen.add_argument("--ignore-eos", action="store_true")
    add_kv_cache_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to a chat model, answers streamed as generated")
    chat.add_argument("--model", default=CHAT_MODEL,
                      help=f"a model name, folder or .gguf file with a chat template (default: "
                           f"{CHAT_MODEL}, installed and converted on first use)")
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=0)
    chat.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    chat.set_defaults(func=cmd_chat)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (streaming, metrics)",
                         description="Serve a model over HTTP with OpenAI's API: "
                         "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.")
    add_serve_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    kv = sub.add_parser("kv-size", help="KV-cache bytes per token for a model or preset")
    kv_size_cmd.add_arguments(kv)
    kv.set_defaults(func=kv_size_cmd.run)

    quant = sub.add_parser("quantize", help="write a checkpoint quantized by GPTQ (fp8, int8)")
    quantize_cmd.add_arguments(quant)
    quant.set_defaults(func=quantize_cmd.run)

    env = sub.add_parser("env", help="this machine: CPU, kernel paths, what computes each op")
    env_cmd.add_arguments(env)
    env.set_defaults(func=env_cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its "Loading weights" bars would bury the output
    try:
        return args.func(args)
    # A user's mistake (a bad value, a wrong path, a corrupt config.json: json.JSONDecodeError is
    # a ValueError) is told in one line; anything else is a bug and keeps its traceback.
    except (ValueError, TypeError, OSError) as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return 2
