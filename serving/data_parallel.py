"""Data parallelism: M engine replicas, each in its own process, behind one HTTP front end.

    pagedllm serve --data-parallel-size 2                          # two replicas of the model
    pagedllm serve --data-parallel-size 2 --tensor-parallel-size 2 # two replicas of two ranks

Tensor parallelism splits one model to make it fit, or a step faster; data parallelism copies
the whole engine to serve more requests at once: each replica has its own weights, its own KV
pool and its own scheduler, and no replica ever waits for another. It buys throughput, not
latency: a request runs on one replica exactly as it would alone.

The pieces, front end first::

    HTTP routes ──> DataParallelEngine.add_request ── routes to the least-loaded replica
                      │                     │
                AsyncLLMEngine 0      AsyncLLMEngine 1     (engine threads, in the front end)
                      │ ReplicaClient 0       │ ReplicaClient 1   (a pipe each)
                ───────────────── process boundary ─────────────────
                   replica 0: LLMEngine   replica 1: LLMEngine     (+ their TP ranks, if any)

Each replica's engine thread is the front end's ordinary ``AsyncLLMEngine``; what it steps is a
``ReplicaClient``, the replica's ``EngineClient``: its calls (``AddRequest``, ``AbortRequest``,
``Step``: ``messages``) are carried to the replica process over a pipe and answered there with
a ``Reply`` that brings the replica's state back. So streaming, aborts, time limits and the
metrics work through the router exactly as they do with one engine, and the replicas step
concurrently (each engine thread waits on its own pipe, not holding the GIL).

Routing: each request goes to the replica with the fewest unfinished requests (counting those
on their way in), ties to the one with the most free KV blocks. The count, not the free blocks
first: blocks are known only after a step, so a burst arriving between two steps would all see
the same free blocks and land on one replica, while the count moves with every request.

Seeds: every replica's engine draws a seed for each request that has none from its own seed
stream (``random.Random(seed)``), so replicas built with the same ``--seed`` would hand the
same seeds out, in the same order, and identical unseeded requests would come out identical on
each replica. Replica i's engine seed is therefore ``replica_seed(--seed, i)``: replica 0 keeps
``--seed`` (one replica behaves as the server without replicas), replica i > 0 takes the i-th
output of SplitMix64 seeded with ``--seed`` — plain integer arithmetic modulo 2**64, the same in
every process and on every run (unlike ``hash``). A request's own seed is never changed: a
seeded request gives the same tokens whichever replica serves it.

Faults: a replica that cannot load sends its error back, and the front end raises it (a
ValueError stays a ValueError, so ``pagedllm serve`` prints the one line it prints without
replicas); one that dies while loading is named with its exit code. A replica whose process
dies later fails the requests it held (the next step's pipe read ends), its gauges fall to 0,
``/health`` answers 503 naming it, and the others go on serving. A call the replica cannot
unpickle fails alone. Shutdown stops every replica (each ends its own tensor-parallel ranks); a
replica whose front end dies sees its pipe close and ends too.
"""

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback

from pagedllm.reference.engine.client import EngineClient, ModelLimits
from pagedllm.reference.engine.outputs import RequestOutput

from .async_engine import AsyncLLMEngine, RequestStream
from .loader import load_llm
from .messages import (
    AbortRequest,
    AddRequest,
    LoadFailed,
    Ready,
    ReplicaInfo,
    ReplicaState,
    Reply,
    Step,
    Stop,
)
from .metrics import ServerMetrics

START_TIMEOUT = 300.0  # seconds for a replica to load its model
STOP_TIMEOUT = 30.0  # seconds for a replica to end after "stop" (it finishes its step first)
# Stats that are the same on every replica (the model's and the pool's settings), not summed.
SHARED_STATS = ("kv_layout", "kv_cache_dtype", "kv_bytes_per_token", "quantization",
                "weight_bytes", "tensor_parallel_size", "float_linears")
# Stats that say what a replica holds now: 0 once its process is gone, so its gauges fall to 0
# rather than freeze at their last values (counters keep their totals: they never go down).
HELD_STATS = ("running", "waiting", "swapped", "blocks_used", "usage", "swapped_blocks",
              "blocks_cached")


class ReplicaDiedError(RuntimeError):
    """A replica's process ended: its requests end with this error."""


class RemoteTraceback(Exception):
    """A replica's traceback, the cause of its error raised again in the front end (so a bug's
    traceback shows where in the replica it happened)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def check_data_parallel_size(size) -> None:
    """Refuse a bad --data-parallel-size before any process starts."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"--data-parallel-size must be an integer >= 1, got {size!r}")


def replica_devices(device: str, gpus: list[str], size: int, tensor_parallel_size: int
                    ) -> tuple[str, list[str | None]]:
    """The device every replica runs on, and each replica's CUDA_VISIBLE_DEVICES.

    ``gpus``: the GPU ids this process sees (``visible_gpus()``). "auto" is decided here, once,
    as ``load_llm`` would decide it: cuda when there is a GPU, else cpu. On CUDA replica i gets
    GPUs i*N .. i*N+N-1 (N: --tensor-parallel-size); off CUDA, None (no GPU to hand out). Too
    few GPUs is refused: a replica given an empty slice would see no GPU, and run on the CPU
    under "auto" without a word.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be an integer >= 1, got "
                         f"{tensor_parallel_size!r}")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if not device.startswith("cuda"):
        return device, [None] * size
    if device != "cuda":  # cuda:K: inside its own GPUs' view a replica's GPU K may not exist
        raise ValueError(f"--device {device} names one GPU; with --data-parallel-size each "
                         "replica takes GPUs of its own: give --device cuda (or auto), and "
                         "CUDA_VISIBLE_DEVICES to choose which GPUs the server may use")
    need = size * tensor_parallel_size
    if need > len(gpus):
        raise ValueError(f"--data-parallel-size {size} x --tensor-parallel-size "
                         f"{tensor_parallel_size} needs {need} GPUs (one per rank); this "
                         f"process sees {len(gpus)}: lower --data-parallel-size, or use "
                         "--device cpu")
    per = tensor_parallel_size
    return device, [",".join(gpus[i * per:(i + 1) * per]) for i in range(size)]


# SplitMix64 (Steele, Lea and Flood 2014), as in reference/ops/sampling.py's random numbers.
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1


def replica_seed(seed, index: int):
    """Replica ``index``'s engine seed, from the server's ``--seed``: ``seed`` itself for replica
    0, else the ``index``-th output of SplitMix64 seeded with ``seed`` (an int in [0, 2**64),
    the range the engine accepts). A seed the engine would refuse (not an int in that range) is
    passed on as it is, for the engine to refuse with its usual message.

        replica_seed(0, 1) == 0xE220A8397B1DCDAF   # SplitMix64's first output from 0
    """
    if index == 0 or isinstance(seed, bool) or not isinstance(seed, int) \
            or not 0 <= seed <= _MASK64:
        return seed
    z = (seed + index * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def replica_args(args: argparse.Namespace, index: int) -> argparse.Namespace:
    """The flags replica ``index`` loads its engine with: the server's, with its own seed."""
    return argparse.Namespace(**{**vars(args), "seed": replica_seed(args.seed, index)})


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (a replica's
    own CUDA_VISIBLE_DEVICES must name the same GPUs, not renumber them from 0)."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(k) for k in range(count)]
    return ids[:count]  # CUDA stops at the first id it cannot use


# -- the replica process ---------------------------------------------------------------------------
def _replica_main(args: argparse.Namespace, index: int, gpus: str | None, conn) -> None:
    """Load the engine, then answer the front end's calls until Stop or the pipe closes."""
    # Ctrl-C reaches every process of the terminal's group: the front end alone answers it,
    # and stops the replicas (and they their ranks) in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpus is not None:  # before CUDA starts in this process: its ranks see only these
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    else:  # the CPU's cores, shared out: M replicas with every core each would thrash
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.data_parallel_size))
    try:
        llm = load_llm(args)
    except BaseException as err:  # noqa: BLE001 - the front end raises it, ends every replica
        # The error itself, not its text: the front end raises the same kind (a ValueError
        # stays a ValueError), so the CLI tells a user's mistake in the same one line.
        conn.send(LoadFailed(_picklable(err), traceback.format_exc()))
        return
    engine, held = llm.engine, set()
    try:
        conn.send(Ready(ReplicaInfo(llm.tokenizer, str(llm.model_dir), engine.limits),
                        _state(engine, held)))
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:  # the front end is gone
                return
            result, error = None, None
            try:
                # Unpickled here, inside the try: a call whose arguments cannot be rebuilt in
                # this process fails alone, answered with the error, and the replica goes on.
                call = _unpickle_call(message, index)
                if isinstance(call, Stop):
                    return
                result = _answer(engine, call, held)
            except Exception as err:  # noqa: BLE001 - the caller gets it, as if called here
                error = _picklable(err)
            conn.send(Reply(_state(engine, held), result, error))
    finally:
        llm.shutdown()


def _unpickle_call(message: bytes, index: int):
    try:
        return pickle.loads(message)
    except Exception as err:  # noqa: BLE001 - whatever rebuilding an argument raised
        raise TypeError(f"data-parallel replica {index} could not unpickle a call "
                        f"({type(err).__name__}: {err}); a call's arguments must be rebuilt in "
                        "the replica's process: plain values, or objects of classes it can "
                        "import") from None


def _answer(engine: EngineClient, call, held: set[str]):
    """Run one call on the replica's engine. ``held``: the ids of the requests it took, kept
    here because the protocol asks the engine about one id at a time (``has_request``)."""
    match call:
        case AddRequest(request_id=request_id, prompt=prompt, params=params):
            held.add(request_id)  # kept only if the engine holds it after the call (_state)
            engine.add_request(request_id, prompt, params)
            return None
        case AbortRequest(request_id=request_id):
            engine.abort_request(request_id)
            return None
        case Step():
            return engine.step()
    raise TypeError(f"unknown replica call {call!r}")


def _state(engine: EngineClient, held: set[str]) -> ReplicaState:
    """What the front end keeps of a replica after every call: no call is needed to read it.
    A finished, aborted or failed request has left the engine: it leaves ``held`` too."""
    held.difference_update([r for r in held if not engine.has_request(r)])
    try:
        engine.check_health()
        health = None
    except Exception as err:  # noqa: BLE001
        health = str(err)
    return ReplicaState(frozenset(held), engine.has_unfinished_requests(), engine.stats(),
                        health)


def _picklable(err: BaseException) -> BaseException:
    """The error itself if it crosses the pipe, else its nearest built-in kind with its text
    (a ValueError subclass whose arguments do not pickle arrives as a ValueError)."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        pass
    kind = next(k for k in type(err).__mro__ if k.__module__ == "builtins")
    text = str(err) if kind is type(err) else f"{err} ({type(err).__name__})"
    try:
        return kind(text)
    except Exception:  # noqa: BLE001 - a kind that takes other arguments (UnicodeDecodeError)
        return RuntimeError(f"{type(err).__name__}: {err}")


# -- the front end's client of one replica ---------------------------------------------------------
class ReplicaClient:
    """The ``EngineClient`` of a replica in another process, for the ``AsyncLLMEngine`` that
    steps it: ``add_request``, ``abort_request`` and ``step`` are calls over the pipe (from the
    one engine thread); ``has_request``, ``has_unfinished_requests``, ``stats`` and
    ``check_health`` read the state the last answer brought, so the event loop never waits on
    a step. Only the engine thread calls, so that state is the replica's own between calls."""

    def __init__(self, index: int, process, conn, ready: Ready):
        self.index, self.process, self.conn = index, process, conn
        self.tokenizer, self.model_dir = ready.info.tokenizer, ready.info.model_dir
        self._limits = ready.info.limits
        self.dead: str | None = None  # why, once its process is gone
        self._state: ReplicaState = ready.state

    @property
    def limits(self) -> ModelLimits:
        return self._limits

    def _call(self, call: AddRequest | AbortRequest | Step):
        if self.dead is not None:
            raise ReplicaDiedError(self.dead)
        try:
            self.conn.send(call)
            reply: Reply = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            self.dead = (f"data-parallel replica {self.index} is down (its process ended with "
                         f"exit code {self.process.exitcode}); its requests were lost, the "
                         "other replicas go on")
            self._state = ReplicaState(frozenset(), False, self._state.stats, self.dead)
            raise ReplicaDiedError(self.dead) from None
        self._state = reply.state
        if reply.error is not None:
            raise reply.error
        return reply.result

    def add_request(self, request_id: str, prompt, params) -> None:
        self._call(AddRequest(request_id, prompt, params))

    def abort_request(self, request_id: str) -> None:
        self._call(AbortRequest(request_id))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._state.request_ids

    def step(self) -> list[RequestOutput]:
        return self._call(Step())

    def has_unfinished_requests(self) -> bool:
        return self._state.unfinished

    def stats(self) -> dict:
        stats = self._state.stats
        if self.dead is None and self.process.is_alive():
            return stats
        # Gone: it holds nothing now (its last answer's numbers would freeze its gauges).
        return {**stats, **{key: 0 for key in HELD_STATS if key in stats}}

    @property
    def is_up(self) -> bool:
        """The process runs and its engine could step at its last answer."""
        # Read-only: only the engine thread updates the proxy's state (its next call fails).
        return self.dead is None and self.process.is_alive() and self._state.health is None

    def check_health(self) -> None:
        if not self.is_up:
            raise RuntimeError(self.dead or self._state.health or
                               f"data-parallel replica {self.index} is down (its process "
                               f"ended with exit code {self.process.exitcode})")

    def shutdown(self) -> None:
        """Ask the process to end (after the step in progress); kill it if it does not. Safe
        to call twice."""
        if self.process.is_alive():
            try:
                self.conn.send(Stop())
            except OSError:
                pass
            self.process.join(STOP_TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.conn.close()


class DataParallelLLM:
    """M replicas of ``load_llm(args)``, each in a process of its own (not daemonic: a
    tensor-parallel replica starts its own rank processes); ``replicas`` are their clients."""

    def __init__(self, args: argparse.Namespace):
        size = args.data_parallel_size
        check_data_parallel_size(size)
        device, gpus = replica_devices(args.device, visible_gpus(), size,
                                       args.tensor_parallel_size)
        args = argparse.Namespace(**{**vars(args), "device": device})  # "auto" decided
        ctx = mp.get_context("spawn")
        starting = []
        for index in range(size):
            parent, child = ctx.Pipe()
            # Its own engine seed: unseeded requests must not get the other replicas' seeds.
            process = ctx.Process(target=_replica_main,
                                  args=(replica_args(args, index), index, gpus[index], child),
                                  name=f"pagedllm-replica-{index}", daemon=False)
            process.start()
            child.close()
            starting.append((index, process, parent))
        try:
            self.replicas: list[ReplicaClient] = wait_ready(starting)
        except BaseException:
            for _, process, conn in starting:
                process.kill()
                process.join(5.0)
                conn.close()
            raise
        self.tokenizer = self.replicas[0].tokenizer
        self.model_dir = self.replicas[0].model_dir
        self.data_parallel_size = size

    def stats(self) -> dict:
        return total_stats([r.stats() for r in self.replicas])

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def wait_ready(starting: list, timeout: float = START_TIMEOUT) -> list[ReplicaClient]:
    """Each replica's client once it has loaded; ``starting``: (index, process, pipe) of each.

    All are watched at once, so the first to fail ends the wait whichever it is. A replica that
    could not load sent its error: it is raised here, the replica's traceback as its cause. One
    that died without a word (killed, out of memory, a crash in C code) closed its pipe: that
    is a RuntimeError naming it and its exit code, not the pipe's bare EOFError.
    """
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    pending = {conn: (index, process) for index, process, conn in starting}
    ready = {}
    while pending:
        readable = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not readable:
            names = ", ".join(str(index) for index in sorted(i for i, _ in pending.values()))
            raise RuntimeError(f"data-parallel replica(s) {names} did not load in "
                               f"{timeout:g} s")
        for conn in readable:
            index, process = pending.pop(conn)
            try:
                message = conn.recv()
            except EOFError:
                process.join(5.0)  # its pipe closed as it ended: the exit code comes a moment later
                raise RuntimeError(f"data-parallel replica {index} died while loading the model "
                                   f"(exit code {process.exitcode})") from None
            match message:
                case LoadFailed(error=error, traceback=trace):
                    raise error from RemoteTraceback(trace)
                case Ready():
                    ready[index] = ReplicaClient(index, process, conn, message)
                case _:
                    raise RuntimeError(f"data-parallel replica {index} sent {message!r} "
                                       "instead of Ready or LoadFailed")
    return [ready[index] for index in sorted(ready)]


def total_stats(per_replica: list[dict]) -> dict:
    """The server's stats: counts summed over the replicas, settings from the first, usage
    recomputed, and each replica's own under "replicas"."""
    total = {key: per_replica[0][key] for key in SHARED_STATS if key in per_replica[0]}
    for key, value in per_replica[0].items():
        if key not in total and isinstance(value, (int, float)) and not isinstance(value, bool):
            total[key] = sum(s[key] for s in per_replica)
    total["usage"] = total["blocks_used"] / total["blocks_total"] if total["blocks_total"] else 0.0
    total["data_parallel_size"] = len(per_replica)
    total["replicas"] = per_replica
    return total


# -- the front end: one AsyncLLMEngine per replica, and the router ---------------------------------
class DataParallelEngine:
    """The server's engine for M replicas: the surface of ``AsyncLLMEngine`` (the routes and
    responses use it unchanged), each request routed to one replica's AsyncLLMEngine. Any
    engine clients will do (``DataParallelLLM.replicas``: one per replica process); replica i's
    metrics carry the label engine="i"."""

    def __init__(self, clients: list[EngineClient], metrics: ServerMetrics):
        self.metrics = metrics
        self.replicas = [AsyncLLMEngine(client, metrics.for_engine(i))
                         for i, client in enumerate(clients)]
        self.tokenizer, self.limits = self.replicas[0].tokenizer, self.replicas[0].limits
        self._incoming = [0] * len(self.replicas)  # routed, not yet taken

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        for replica in self.replicas:
            replica.start(loop)

    def shutdown(self, timeout: float = 30.0) -> None:
        for replica in self.replicas:
            replica.shutdown(timeout)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def stats(self) -> dict:
        return total_stats([r.stats for r in self.replicas])

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.replicas)

    def check_health(self) -> None:
        down = [error for error in map(_health_error, self.replicas) if error is not None]
        if down:
            raise RuntimeError("; ".join(down))

    def route(self) -> int:
        """The replica for the next request: the fewest unfinished (with those on their way),
        then the most free KV blocks; a replica that is down takes none while another is up."""
        def load(i: int):
            replica = self.replicas[i]
            stats = replica.stats
            return (_health_error(replica) is not None,
                    replica.num_unfinished + self._incoming[i],
                    stats["blocks_used"] - stats["blocks_total"], i)
        return min(range(len(self.replicas)), key=load)

    async def add_request(self, request_id: str, prompt, params, arrival: float | None = None,
                          queue: asyncio.Queue | None = None) -> RequestStream:
        i = self.route()
        self._incoming[i] += 1
        try:
            return await self.replicas[i].add_request(request_id, prompt, params, arrival,
                                                      queue)
        finally:
            self._incoming[i] -= 1

    def abort(self, request_id: str) -> None:
        """Abort on every replica: a no-op on those that do not hold it (no pipe call), so the
        router keeps no map of requests that would outlive them."""
        for replica in self.replicas:
            replica.abort(request_id)


def _health_error(replica: AsyncLLMEngine) -> str | None:
    """Why the replica cannot step, or None. A replica client answers from its last state,
    without a call, so the router may ask before every request."""
    try:
        replica.check_health()
    except Exception as err:  # noqa: BLE001 - any failure: down, and why
        return str(err)
    return None
