"""What every exercise test shares: run each test on the solution and on your file.

A test module names its exercise, e.g. ``EXERCISE = "paging_exercise"``. A test that asks for
the ``impl`` fixture then runs twice: once on solutions/paging_exercise.py and once on your
paging_exercise.py, each loaded by file path (so lessons/ needs no __init__.py). While your
function still raises NotImplementedError, ``impl.use`` and ``impl.skip_if_not_attempted`` skip
the test on your side; on the solution's side the error fails it.
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def implementations(exercise: str) -> dict[str, Path]:
    """The two files of an exercise: the solution, and the one you edit."""
    return {"solution": HERE / "solutions" / f"{exercise}.py", "yours": HERE / f"{exercise}.py"}


def not_attempted(exercise: str) -> str:
    return (f"exercise not attempted yet: edit lessons/exercises/{exercise}.py / "
            f"아직 풀지 않은 연습 문제: lessons/exercises/{exercise}.py를 고치세요")


def load(exercise: str, name: str) -> ModuleType:
    """Import the "solution" or "yours" file of an exercise by its path."""
    spec = importlib.util.spec_from_file_location(f"{exercise}_{name}",
                                                  implementations(exercise)[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SkipIfNotAttempted:
    """NotImplementedError inside: skips the test on your file, fails it on the solution."""

    def __init__(self, exercise: str, name: str):
        self.exercise, self.name = exercise, name

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, traceback) -> None:
        __tracebackhide__ = True  # pytest then reports the skip at the test file's line
        if kind is not None and issubclass(kind, NotImplementedError) and self.name == "yours":
            pytest.skip(not_attempted(self.exercise))


@dataclass(frozen=True)
class Implementation:
    exercise: str  # e.g. "paging_exercise"
    name: str  # "solution" or "yours"
    module: ModuleType

    def skip_if_not_attempted(self) -> SkipIfNotAttempted:
        return SkipIfNotAttempted(self.exercise, self.name)

    def use(self, function: str, *probe):
        """The function, once calling it with the probe arguments raises no NotImplementedError."""
        __tracebackhide__ = True
        fn = getattr(self.module, function)
        with self.skip_if_not_attempted():
            fn(*probe)
        return fn


@pytest.fixture(params=["solution", "yours"])
def impl(request) -> Implementation:
    exercise = request.module.EXERCISE
    return Implementation(exercise, request.param, load(exercise, request.param))
