"""Launch: ``pagedllm serve``'s engine from its flags, the app around it, and uvicorn running it.

``serve`` is the command (``cli.cmd_serve``). It loads the model (``loader.load_llm``, or
``data_parallel.DataParallelLLM`` for replicas), builds the async front end that steps it
(``AsyncLLMEngine``, or the ``DataParallelEngine`` router), hands that to ``api_server``'s
``build_app``, binds the socket before the banner is printed (``server_thread.bind``: the
banner names the real port, and ``--port 0`` works) and runs uvicorn on it.
"""

import argparse
import logging
import sys

from .api_server import build_app
from .args import FLASH_ATTN_NOTE
from .async_engine import AsyncLLMEngine
from .data_parallel import DataParallelEngine, DataParallelLLM
from .loader import load_llm
from .metrics import ServerMetrics
from .server_thread import bind


def served_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or args.model_tag or "tiny-pydoc"


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.request_timeout < 0:
        raise ValueError(f"--request-timeout must be >= 0 seconds, got {args.request_timeout}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.enable_flash_attn:
        print(f"pagedllm: {FLASH_ATTN_NOTE}", file=sys.stderr, flush=True)
    _log_to_stderr()
    name = served_name(args)
    metrics = ServerMetrics(name)
    replicated = args.data_parallel_size != 1
    # Every replica loads its own copy, in its own process: the front end steps their clients.
    llm = DataParallelLLM(args) if replicated else load_llm(args)
    try:  # whatever fails from here on, the replicas and ranks end
        engine = (DataParallelEngine(llm.replicas, metrics) if replicated
                  else AsyncLLMEngine(llm.engine, metrics))
        app = build_app(engine, name, root=str(llm.model_dir), api_key=args.api_key,
                        max_request_bytes=args.max_request_bytes,
                        request_timeout=args.request_timeout or None,
                        log_requests=not args.disable_log_requests)
        sock = bind(args.host, args.port)  # bound before the banner, so the port is known
        host, port = sock.getsockname()[:2]
        stats = llm.stats()
        replicas = f"{args.data_parallel_size} replicas, " if replicated else ""
        print(f"pagedllm: serving {name} ({args.tier} tier, {replicas}{stats['blocks_total']} KV "
              f"blocks of {args.block_size} tokens, max_model_len {engine.limits.max_model_len})"
              f" on http://{host}:{port}/v1", flush=True)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        llm.shutdown()  # a tensor-parallel engine's worker ranks end with the server
    return 0


def _log_to_stderr() -> None:
    """The server's own INFO lines (each request, unless --disable-log-requests; what a flag
    was taken as) on stderr beside uvicorn's, once per process."""
    logger = logging.getLogger("pagedllm.serving")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
