"""The build-it track's machinery: load each piece, yours or the solution's, and put an engine
together from them. Given: nothing to write here. The tests use it, and so can you:

    python lessons/build/build_track.py

runs your engine (milestone 7) on the track's fixed workload, built from your pieces where you
have written them and from the solutions' where not, and compares its tokens with pagedllm's.

A piece counts as written once its probe, a few small calls, raises no NotImplementedError.
A piece that is written but wrong is still used: its own tests, and the end-to-end test, say
what is wrong with it.
"""

import importlib.util
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the pieces import build_types, which lives here
    sys.path.insert(0, str(HERE))

from build_types import Parts, ScheduledSeq, SchedulerOutput, Sequence  # noqa: E402

# The pieces, in the order the track builds them: file name -> milestone.
PIECES = {"kv_cache": 1, "block_manager": 2, "scheduler": 3, "prefix_cache": 4,
          "step_inputs": 5, "sampler": 6, "engine": 7}

_loaded: dict[tuple[str, str], ModuleType] = {}


def piece_path(piece: str, side: str) -> Path:
    """side "yours": lessons/build/<piece>.py; "solution": lessons/build/solutions/<piece>.py."""
    return HERE / f"{piece}.py" if side == "yours" else HERE / "solutions" / f"{piece}.py"


def load(piece: str, side: str) -> ModuleType:
    """Import one side's file of a piece by its path (once per process)."""
    if (piece, side) not in _loaded:
        spec = importlib.util.spec_from_file_location(f"build_{side}_{piece}",
                                                      piece_path(piece, side))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[piece, side] = module
    return _loaded[piece, side]


# -- probes: a few small calls that reach every function a later piece relies on ----------
def _probe_kv_cache(m: ModuleType) -> None:
    k, v = m.allocate_kv_cache(1, 2, 2, 1, 2)
    m.store_kv(torch.ones(1, 1, 2), torch.ones(1, 1, 2), k[0], v[0], torch.tensor([1]))
    m.paged_attention(torch.ones(1, 1, 2), k[0], v[0], torch.tensor([[0]], dtype=torch.int32),
                      torch.tensor([2], dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32), 1.0)
    m.copy_blocks(k, v, [(0, 1)])


def _probe_block_manager(m: ModuleType, prefix_cache=None) -> None:
    bm = m.BlockManager(4, 2, prefix_cache)
    token_ids = [1, 2, 3] if prefix_cache is not None else None
    bm.can_allocate(3, token_ids)
    bm.allocate(0, 3, token_ids)
    bm.num_cached_tokens(0)
    bm.mark_computed(0, [1, 2, 3], 3)
    bm.can_append(0)
    bm.append_slot(0)
    bm.fork(0, 1)
    bm.append_slot(1)
    bm.block_table(1), bm.num_tokens(1), bm.ref_count(0), bm.num_free_blocks
    bm.free(1)
    bm.free(0)


def _probe_block_manager_with_prefix_cache(m: ModuleType) -> None:
    _probe_block_manager(m, load("prefix_cache", "solution").PrefixCache(2))


def _probe_scheduler(m: ModuleType) -> None:
    bm = load("block_manager", "solution").BlockManager(8, 2)
    scheduler = m.Scheduler(bm, 2, 16)
    scheduler.add(Sequence(0, [1, 2, 3], 2, 0))
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update(out, [5] * sum(item.samples for item in out.scheduled))
    scheduler.has_unfinished()


def _probe_prefix_cache(m: ModuleType) -> None:
    cache = m.PrefixCache(2)
    key = cache.key(None, [1, 2])
    cache.register(key, 0)
    cache.lookup([1, 2, 3])
    cache.evict(0)


def _probe_step_inputs(m: ModuleType) -> None:
    bm = load("block_manager", "solution").BlockManager(4, 2)
    bm.allocate(0, 3)
    m.build_step_inputs(SchedulerOutput([ScheduledSeq(Sequence(0, [1, 2, 3], 1, 0), 3)]), bm)


def _probe_sampler(m: ModuleType) -> None:
    m.sample(torch.zeros(1, 3), torch.zeros(1), torch.full((1,), -1),
             torch.Generator().manual_seed(0))


PROBES = {"kv_cache": _probe_kv_cache, "block_manager": _probe_block_manager,
          "scheduler": _probe_scheduler, "prefix_cache": _probe_prefix_cache,
          "step_inputs": _probe_step_inputs, "sampler": _probe_sampler}


def not_written(piece: str, probe=None) -> str | None:
    """None once your piece's probe raises no NotImplementedError; else the error's message."""
    try:
        (probe or PROBES[piece])(load(piece, "yours"))
    except NotImplementedError as err:
        return str(err) or f"{piece_path(piece, 'yours').name} raises NotImplementedError"
    except Exception:  # noqa: BLE001 - written, with a bug its own tests will show
        return None
    return None


# Which pieces the "yours" runs used, and why a solution stood in: the tests' summary.
USED: dict[str, str] = {}


def compose(side: str, own: str | None = None, prefix_caching: bool = False) -> Parts:
    """Every piece from one side; on "yours", the solution's wherever yours is not written
    yet (own, the piece under test, is always yours). prefix_caching: the block manager must
    also take a prefix cache (milestone 4's part of it)."""
    origin = {}
    for piece in PIECES:
        if piece == "engine":
            continue
        if side == "solution":
            origin[piece] = "solution"
            continue
        missing = None if piece == own else not_written(piece)
        if missing is None and piece == "block_manager" and prefix_caching and own != piece:
            missing = not_written(piece, _probe_block_manager_with_prefix_cache)
        origin[piece] = "yours" if missing is None else f"solution (yours: {missing})"
        if piece != own:
            USED[piece] = origin[piece]
    mods = {piece: load(piece, "yours" if o == "yours" else "solution")
            for piece, o in origin.items()}
    kv = mods["kv_cache"]
    return Parts(allocate_kv_cache=kv.allocate_kv_cache, store_kv=kv.store_kv,
                 paged_attention=kv.paged_attention, copy_blocks=kv.copy_blocks,
                 BlockManager=mods["block_manager"].BlockManager,
                 Scheduler=mods["scheduler"].Scheduler,
                 PrefixCache=mods["prefix_cache"].PrefixCache,
                 build_step_inputs=mods["step_inputs"].build_step_inputs,
                 sample=mods["sampler"].sample, origin=origin)


# -- what the tests share ------------------------------------------------------------------
def expect(ok, message: str) -> None:
    """Fail with the message alone (a tensor comparison's repr would bury it)."""
    if not bool(ok):
        pytest.fail(message, pytrace=False)


def refuses(error: type[Exception], why: str, call, *args) -> None:
    """call(*args) must raise error; if not, fail saying why it should."""
    try:
        call(*args)
    except error:
        return
    except NotImplementedError:
        raise  # not written yet: a skip
    except Exception as err:  # noqa: BLE001
        pytest.fail(f"{why}: expected {error.__name__}, got {type(err).__name__}: {err}",
                    pytrace=False)
    pytest.fail(f"{why}: expected {error.__name__}, nothing was raised", pytrace=False)


# -- the fixed workload of milestone 7 -----------------------------------------------------
# Three prompts share a long first sentence (prefix caching finds its blocks), three are
# short; six requests, at most four running, in a pool of 16 blocks of 4 slots: requests
# wait, and running ones are preempted as they grow.
SHARED = "Return a list of the words in the string, using sep as the delimiter."
PROMPTS = [SHARED + " def split(", SHARED + " Example:", SHARED + " If sep is not given,",
           "The dictionary", "import os\nos.path.join(", "class Queue:"]
MAX_TOKENS = 24


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 16
    block_size: int = 4
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    enable_prefix_caching: bool = True

    def kwargs(self) -> dict:
        return asdict(self)


def workload_prompts() -> list[list[int]]:
    """The workload's prompts as the shipped tiny model's token ids."""
    from pagedllm.reference.model.loader import load_tokenizer
    from pagedllm.serving.default_model import default_model_dir

    tokenizer = load_tokenizer(default_model_dir())
    return [tokenizer.encode(p) for p in PROMPTS]


def pagedllm_tokens(prompts: list[list[int]], max_tokens: int,
                    config: EngineConfig) -> list[list[int]]:
    """pagedllm's own greedy tokens (pagedllm.reference.LLM), under the same budgets."""
    from pagedllm.reference import LLM, SamplingParams
    from pagedllm.serving.default_model import default_model_dir

    llm = LLM(default_model_dir(), block_size=config.block_size,
              num_gpu_blocks=config.num_blocks, max_num_seqs=config.max_num_seqs,
              max_num_batched_tokens=config.max_num_batched_tokens,
              max_model_len=config.max_num_batched_tokens,
              enable_prefix_caching=config.enable_prefix_caching)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def differences(got: list[list[int]], expected: list[list[int]],
                prompts: list[list[int]]) -> str | None:
    """None when every request's tokens agree; else which differ, where, and what it hints."""
    lines = []
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g == e:
            continue
        pairs = enumerate(zip(g, e, strict=False))
        first = next((j for j, (a, b) in pairs if a != b), min(len(g), len(e)))
        hint = ("the prefill (positions, slots, attention over the prompt, the logits row)"
                if first == 0 else "a decode step, a preemption's recompute or a cache hit")
        lines.append(f"request {i} ({len(prompts[i])}-token prompt): your engine gave {g}, "
                     f"pagedllm {e}; they part at output token {first}: look at {hint}")
    return "\n".join(lines) or None


def main() -> None:
    torch.set_num_threads(1)
    from pagedllm.reference import load_model
    from pagedllm.serving.default_model import default_model_dir

    config = EngineConfig()
    parts = compose("yours", prefix_caching=config.enable_prefix_caching)
    engine_side, origin = "yours", dict(parts.origin)
    try:
        load("engine", "yours").MiniEngine.step(None)
    except NotImplementedError as err:
        engine_side = "solution"
        origin["engine"] = f"solution (yours: {err})"
    except Exception:  # noqa: BLE001 - written: step(None) only tells whether it is
        pass
    origin.setdefault("engine", engine_side)
    for piece, o in origin.items():
        print(f"{PIECES[piece]}. {piece:<14} {o}")
    prompts = workload_prompts()
    engine = load("engine", engine_side).MiniEngine(
        load_model(default_model_dir()), parts, **config.kwargs())
    got = engine.generate(prompts, MAX_TOKENS)
    wrong = differences(got, pagedllm_tokens(prompts, MAX_TOKENS, config), prompts)
    print(wrong or f"all {len(prompts)} requests: the same {MAX_TOKENS} tokens as pagedllm")


if __name__ == "__main__":
    main()
