"""Launch: the LLM from the flags of ``pagedllm serve``, the socket, and uvicorn running the app.

``serve`` is the command (``cli.cmd_serve``); ``load_llm`` builds the LLM of the chosen tier;
``bind`` opens the socket before the banner is printed, so the banner names the real port (and
``--port 0`` works); ``ServerThread`` runs an app on loopback in a thread for tests and notebooks.
"""

import argparse
import socket
import threading
import time


def load_llm(args: argparse.Namespace):
    """The LLM of the chosen tier, configured from the flags (the engine checks them)."""
    import torch

    from .default_model import default_model_dir

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model or args.model_tag or default_model_dir()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if args.preemption_mode == "swap" and args.swap_space == 0:
        raise ValueError("--preemption-mode swap moves blocks to CPU memory: give it some with "
                         "--swap-space GIB (e.g. --swap-space 1)")
    options = dict(dtype=args.dtype, device=device, block_size=args.block_size,
                   num_gpu_blocks=args.num_gpu_blocks_override,
                   kv_cache_memory=args.kv_cache_memory_bytes, swap_space=args.swap_space,
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   max_model_len=args.max_model_len, preemption_mode=args.preemption_mode,
                   enable_prefix_caching=args.enable_prefix_caching,
                   enable_chunked_prefill=args.enable_chunked_prefill, seed=args.seed,
                   gpu_memory_utilization=args.gpu_memory_utilization,
                   enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                   calculate_kv_scales=args.calculate_kv_scales,
                   quantization=args.quantization,
                   quantization_group_size=args.quantization_group_size,
                   quantization_skip=tuple(args.quantization_skip),
                   tensor_parallel_size=args.tensor_parallel_size,
                   max_logprobs=args.max_logprobs)
    if args.tier == "optimized":
        from pagedllm.optimized import LLM
    else:
        from pagedllm.reference.engine.llm import LLM
    return LLM(model, **options)


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or args.model_tag or "tiny-pydoc"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    # Imported here, not at the top: api_server re-exports this module's names.
    from .api_server import build_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0 seconds, got {args.request_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.data_parallel_size == 1:
        llm = load_llm(args)
    else:
        from .data_parallel import DataParallelLLM

        llm = DataParallelLLM(args)  # every replica loads its own copy, in its own process
    try:  # whatever fails from here on, the replicas and ranks end
        name = served_name(args)
        app = build_app(llm, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                        request_timeout=args.request_timeout or None)
        sock = bind(args.host, args.port)  # bound before the banner, so the port is known
        host, port = sock.getsockname()[:2]
        stats = llm.stats()
        replicas = (f"{args.data_parallel_size} replicas, " if args.data_parallel_size > 1
                    else "")
        print(f"pagedllm: serving {name} ({args.tier} tier, {replicas}{stats['blocks_total']} KV "
              f"blocks of {args.block_size} tokens, max_model_len {app.state.engine.max_model_len})"
              f" on http://{host}:{port}/v1", flush=True)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        llm.shutdown()  # a tensor-parallel engine's worker ranks end with the server
    return 0


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {err.strerror}") from None
    # Listening now, not when uvicorn starts: a client that connects as soon as it reads the
    # banner waits in the backlog instead of being refused (seen in CI under load).
    sock.listen(2048)
    return sock


class ServerThread:
    """Run an app on loopback in a background thread (tests, notebooks)::

        with ServerThread(build_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
