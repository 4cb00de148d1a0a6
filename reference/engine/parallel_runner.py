"""Tensor-parallel execution: rank 0's model runner drives ranks 1..N-1 through the same seam.

The engine does not change. It schedules, keeps the KV bookkeeping and builds each step's inputs
once, on rank 0, and calls its runner as always; with ``tensor_parallel_size=N`` that runner is
a ``TensorParallelRunner``, which hands every step to the other ranks before running its own
shard of the model::

    rank 0 (the caller's process)                    ranks 1..N-1 (worker processes)
      engine: schedule, KV bookkeeping, inputs          waiting for the next step
      runner.move_blocks(...)     (queued for the workers, done on rank 0's pool now)
      runner.execute(inputs)
        publish (block moves, step tensors) --------->  the same moves on my pool
        my shard's forward  <---- 2 all-reduces per layer ---->  my shard's forward
        logits [S, vocab]   <---- gather ------------------  my slice of the logits
      sample, update, stops (rank 0 only)

Each rank holds its shard of every layer (``model/tensor_parallel.py``) and its own KV pool with
its KV heads only; the block tables, slot mapping and block moves are the same on every rank,
because blocks are numbered alike everywhere and only the heads inside a block differ.

How a step reaches the workers: rank 0 pickles the step's tensors (and the block moves queued
since the last step) into torch.distributed's key-value store (a ``TCPStore`` served by rank
0), under the step's number; each worker waits for that key. A store wait can time out and be
retried, so a worker idles for as long as the server does, while the collectives of the
forward run over gloo (the CPU) or NCCL (GPUs) with a bounded timeout. vLLM broadcasts each
SchedulerOutput through a shared-memory ring buffer and nano-vllm through a shared-memory block
plus events: faster on one machine, but a store also reaches the ranks of other machines
(``torchrun --nnodes``).

Ranks 1..N-1 are started here (torch.multiprocessing, spawn), or by ``torchrun``: then every
process runs the user's script, rank 0's ``LLM(...)`` becomes the engine, and on the other ranks
``LLM(...)`` serves as that rank's worker and ends the process when rank 0 shuts down.

Faults: a worker that dies makes the next collective fail (its sockets close) or time out
(``COLLECTIVE_TIMEOUT``); either way the runner ends every rank, frees the process group and
raises; the engine finishes the step's requests with an error, and every later step raises
at once: the engine is down (``check_health``) and a new one can be built.
"""

import os
import pickle
import time
import traceback
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..kv import KVCacheConfig
from ..model.rank_loader import load_rank_model
from .step_inputs import StepInputs

COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # a hung rank fails the step after this
STORE_POLL = timedelta(seconds=5)  # a waiting worker looks up at least this often
START_TIMEOUT = 300.0  # seconds for every worker to load its shard and join


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank stopped: the engine is down and must be rebuilt."""


@dataclass
class StepMessage:
    """What a worker needs of a step: the block moves, then the forward's tensors (the
    sampling rows stay on rank 0, which alone samples)."""

    moves: list[tuple[list, list, list]]  # (swap_out, swap_in, copy) per engine step
    inputs: StepInputs | None  # None, and no kv_cache_config: shut down
    # the pool the engine sized (a message of its own, before any step): each rank allocates
    # its own heads' share
    kv_cache_config: KVCacheConfig | None = None


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (RANK in the environment), else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "MASTER_ADDR" in os.environ \
        else None


# -- rank 0 ------------------------------------------------------------------------------------
# --8<-- [start:runner]
class TensorParallelRunner:
    """Rank 0's runner: the tier's runner over rank 0's shard, plus the other ranks."""

    def __init__(self, runner, config):
        self.runner, self.config = runner, config
        self.world_size = config.tensor_parallel_size
        self.pending_moves: list[tuple[list, list, list]] = []
        self.publish_seconds: list[float] = []  # per step: putting it in the store
        self.error: BaseException | None = None
        self.ranks = Ranks(*_start_ranks(config))
        # Ended by shutdown(), at exit, or when the runner is collected (a dropped
        # LLM must not keep its processes and its process group): the finalizer
        # holds the ranks, not self.
        self._finalizer = weakref.finalize(self, self.ranks.shutdown, True)

    # What the engine reads of a runner, rank 0's.
    @property
    def model(self):
        return self.runner.model

    @property
    def backend(self):
        return self.runner.backend

    def kernels(self) -> dict[str, str]:
        return self.runner.kernels()  # every rank runs the same backend

    @property
    def cache_engine(self):
        return self.runner.cache_engine  # rank 0's pool (its KV heads)

    @property
    def workers(self) -> list:
        """The spawned ranks' processes (none under torchrun)."""
        return self.ranks.workers

    def get_kv_cache_spec(self, block_size: int):
        return self.runner.get_kv_cache_spec(block_size)  # rank 0's heads

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Every rank allocates the engine's pool, its own KV heads' share: rank 0
        here, the workers from a message; the engine is built only once all have (a
        rank that cannot allocate fails the engine's construction, not its first
        request)."""
        self.runner.initialize_kv_cache(kv_cache_config)
        try:
            self._publish(StepMessage([], None, kv_cache_config))
            _wait_for_ranks(self.ranks, "allocated", self.world_size)
        except BaseException as err:
            self._fail(err)
            raise self.error from err
        self.ranks.store.delete_key(_key(self.ranks.step_number - 1))

    def move_blocks(self, swap_out, swap_in, copy) -> None:
        self.check_health()
        self.runner.move_blocks(swap_out, swap_in, copy)
        if swap_out or swap_in or copy:  # the workers do them before their next forward
            self.pending_moves.append((swap_out, swap_in, copy))

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Publish the step, then run rank 0's shard: logits [S, vocab], gathered
        here."""
        self.check_health()
        try:
            start = time.perf_counter()
            self._publish(StepMessage(self.pending_moves, _without_sampling(inputs)))
            self.publish_seconds.append(time.perf_counter() - start)
            self.pending_moves = []
            logits = self.runner.execute(inputs)  # collectives with every rank inside
        except BaseException as err:
            # The ranks are now out of step (some inside a collective, some not): end
            # them all.
            self._fail(err)
            raise self.error from err
        # every rank has read it
        self.ranks.store.delete_key(_key(self.ranks.step_number - 1))
        return logits
    # --8<-- [end:runner]

    def sample(self, logits, sampling):
        return self.runner.sample(logits, sampling)

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank has stopped (the engine is then down)."""
        if self.error is None:
            dead = [(rank, p.exitcode) for rank, p in enumerate(self.ranks.workers, 1)
                    if not p.is_alive()]
            if dead:
                self._fail(None)
        if self.error is not None:
            raise self.error

    def _publish(self, message: StepMessage) -> None:
        self.ranks.publish(message)

    def _fail(self, err: BaseException | None) -> None:
        codes = ", ".join(f"rank {rank}: exit code {p.exitcode}" if p.exitcode is not None
                          else f"rank {rank}: running"
                          for rank, p in enumerate(self.ranks.workers, 1))
        reason = f"{type(err).__name__}: {err}" if err is not None else "a worker process ended"
        codes = codes or "ranks started by torchrun"
        self.error = WorkerDiedError(f"the tensor-parallel engine is down ({reason}; {codes}); "
                                     "its requests end with an error: build a new engine")
        self.shutdown(graceful=False)

    def shutdown(self, graceful: bool = True) -> None:
        """End every rank (a shutdown message, then a kill after a grace period) and free the
        process group. Safe to call twice."""
        self._finalizer.detach()
        self.ranks.shutdown(graceful and self.error is None)


class Ranks:
    """The worker processes and the step store a tensor-parallel runner started: an object of
    their own, so that ending them never needs the runner (a finalizer may run after it is
    gone)."""

    def __init__(self, workers: list, store: dist.Store):
        self.workers, self.store = workers, store
        self.step_number = 0

    def publish(self, message: StepMessage) -> None:
        self.store.set(_key(self.step_number), pickle.dumps(message))
        self.step_number += 1

    def shutdown(self, graceful: bool) -> None:
        if self.store is None:
            return
        if graceful:
            try:
                self.publish(StepMessage([], None))
            except Exception:  # noqa: BLE001 - the store is gone: the workers end by themselves
                pass
        for p in self.workers:
            p.join(10.0 if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def _key(step: int) -> str:
    return f"pagedllm/step/{step}"


def _without_sampling(inputs: StepInputs) -> StepInputs:
    return StepInputs(inputs.input_ids, inputs.positions, inputs.attn_metadata,
                      inputs.logits_indices, rows=[], sampling=None,
                      kv_group_metadata=inputs.kv_group_metadata)


def _start_ranks(config) -> tuple[list, dist.Store]:
    """Start ranks 1..N-1 (or join torchrun's) and the process group; rank 0 is this process.
    Returns the spawned processes (none under torchrun) and the step store."""
    if dist.is_initialized():
        raise RuntimeError("this process already runs a torch.distributed process group (another "
                           "tensor-parallel engine?): shut that engine down first")
    tp, backend = config.tensor_parallel_size, _backend(config)
    if torchrun_rank() is not None:  # torchrun started every rank: its environment rendezvous
        _check_torchrun_world(tp)
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        store = _step_store(is_master=True)
        for rank in range(1, tp):  # each rank has its shard
            store.wait([f"pagedllm/loaded/{rank}"], timedelta(seconds=START_TIMEOUT))
        return [], store
    store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = []
    quiet = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # a store wait's timeout is routine, not news
    try:
        for rank in range(1, tp):
            p = ctx.Process(target=_worker_main, args=(config, rank, store.port, os.getpid()),
                            name=f"pagedllm-tp-rank{rank}", daemon=True)
            p.start()
            workers.append(p)
    finally:
        if quiet is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL")
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = quiet
    try:
        _wait_for_workers(store, "joined", workers)
        dist.init_process_group(backend, store=store, rank=0, world_size=tp,
                                timeout=COLLECTIVE_TIMEOUT)
        _wait_for_workers(store, "loaded", workers)  # each rank has its shard
    except BaseException as err:
        for p in workers:
            p.join(1.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        codes = [p.exitcode for p in workers]
        raise RuntimeError(
            f"tensor-parallel workers did not start (exit codes {codes}; their errors are "
            "printed above). A script that builds a tensor-parallel engine must do so under "
            "`if __name__ == \"__main__\":`, because each worker is spawned and imports the "
            "script again") from err
    return workers, store


def _wait_for_workers(store: dist.Store, what: str, workers: list) -> None:
    """Wait until every spawned rank has set its key (joined the store, loaded its shard),
    failing as soon as one of them has ended, or after START_TIMEOUT. It polls with
    ``check``, which never times out: a timed-out ``wait`` logs a line from c10d each time,
    dozens while a shard loads."""
    deadline = time.monotonic() + START_TIMEOUT
    for rank, p in enumerate(workers, 1):
        while not store.check([f"pagedllm/{what}/{rank}"]):
            if not p.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} has not {what}")
            time.sleep(0.05)


def _wait_for_ranks(ranks: "Ranks", what: str, world_size: int) -> None:
    """Every other rank has set pagedllm/<what>/<rank>: spawned ones are watched as they go
    (a dead one fails at once); torchrun's are waited for up to START_TIMEOUT."""
    if ranks.workers:
        _wait_for_workers(ranks.store, what, ranks.workers)
        return
    for rank in range(1, world_size):
        ranks.store.wait([f"pagedllm/{what}/{rank}"], timedelta(seconds=START_TIMEOUT))


def _backend(config) -> str:
    return "nccl" if config.device.type == "cuda" else "gloo"


def _check_torchrun_world(tp: int) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise ValueError(f"tensor_parallel_size {tp} under torchrun needs {tp} processes in all "
                         f"(--nnodes x --nproc-per-node); WORLD_SIZE is {world}")


def _step_store(is_master: bool) -> dist.Store:
    """torchrun's case: a store of our own beside torchrun's, one port above MASTER_PORT."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
                         int(os.environ["WORLD_SIZE"]), is_master=is_master,
                         timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


# -- ranks 1..N-1 --------------------------------------------------------------------------------
def _worker_main(config, rank: int, port: int, parent_pid: int) -> None:
    """A spawned worker: join the group, load the shard, serve steps until told to stop."""
    torch.set_num_threads(1)  # a rank per core: they share the machine with rank 0
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(f"pagedllm/joined/{rank}", "1")
    dist.init_process_group(_backend(config), store=store, rank=rank,
                            world_size=config.tensor_parallel_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        serve_steps(config, rank, store, parent_pid)
    except Exception:  # noqa: BLE001 - the parent sees the exit code; the trace says why
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


def run_torchrun_worker(config) -> None:
    """Ranks 1..N-1 under torchrun: the same loop, joined through torchrun's environment."""
    _check_torchrun_world(config.tensor_parallel_size)
    dist.init_process_group(_backend(config), timeout=COLLECTIVE_TIMEOUT)
    try:
        serve_steps(config, dist.get_rank(), _step_store(is_master=False), None)
    finally:
        dist.destroy_process_group()


# --8<-- [start:worker]
def serve_steps(config, rank: int, store: dist.Store,
                parent_pid: int | None) -> None:
    """One rank's loop: its shard; its pool, as rank 0 sized it (with the
    first step); each step's block moves, then its forward."""
    runner = config.model_runner(load_rank_model(config, rank), config, rank)
    store.set(f"pagedllm/loaded/{rank}", "1")  # rank 0 may start
    step = 0
    while True:
        message = _next_step(store, step, parent_pid)
        step += 1
        if message.kv_cache_config is not None:  # the same blocks, this rank's KV heads
            pool = message.kv_cache_config
            runner.initialize_kv_cache(replace(
                pool, kv_cache_groups=runner.get_kv_cache_spec(pool.block_size)))
            store.set(f"pagedllm/allocated/{rank}", "1")
            continue
        if message.inputs is None:
            return
        for moves in message.moves:
            runner.move_blocks(*moves)
        runner.execute(message.inputs)  # the collectives: rank 0 gets the logits
# --8<-- [end:worker]


def _next_step(store: dist.Store, step: int, parent_pid: int | None) -> StepMessage:
    """Wait for step `step`'s message, as long as it takes, while rank 0 is alive."""
    while True:
        try:
            store.wait([_key(step)], STORE_POLL)
            return pickle.loads(store.get(_key(step)))
        except dist.DistStoreError:  # the wait timed out: rank 0 is idle
            if parent_pid is not None and os.getppid() != parent_pid:
                raise RuntimeError("rank 0's process ended; this worker stops too") from None
