"""Checks lesson 15's exercise: the deltas a stream sends, against the engine's real snapshots.

    pytest lessons/exercises/test_stream_exercise.py

Each test runs twice: against the solution (always) and against your file,
lessons/exercises/stream_exercise.py (skipped while it still raises NotImplementedError);
conftest.py loads both by file path.
The snapshots come from the reference engine on the tiny model, stepped by hand as the server's
engine thread steps it, with stop strings that do occur in its text.
"""

import pytest

from pagedllm.reference.engine.llm import LLM
from pagedllm.reference.engine.sampling_params import SamplingParams
from pagedllm.serving.default_model import default_model_dir

EXERCISE = "stream_exercise"  # impl (conftest.py): the solution's file, then yours


@pytest.fixture
def stream_deltas(impl):
    return impl.use("stream_deltas", ["a"], 0)


@pytest.fixture(scope="module")
def engine_runs():
    """(snapshots, longest stop) of real requests, one snapshot per step."""
    llm = LLM(default_model_dir())
    runs, stopped = [], 0
    for i, (prompt, stop) in enumerate([
            ("The for statement is used to", ["the"]),
            ("Return a list of the", [". ", "xyz-never"]),
            ("This module provides", ["\n"]),
            ("An exception is raised when", None),
            ("The default value of", ["e", "is a"])]):
        params = SamplingParams(temperature=0.7, seed=i, max_tokens=60, stop=stop)
        llm.engine.add_request(str(i), prompt, params)
        snapshots, reason = [], None
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                snapshots.append(out.outputs[0].text)
                reason = out.outputs[0].stop_reason
        runs.append((snapshots, max((len(s) for s in params.stop_strings), default=0)))
        stopped += isinstance(reason, str)
    assert stopped >= 3, ("stop strings should end most of these requests"
                          "\n이 요청들은 대부분 정지 문자열로 끝나야 합니다")
    return runs


def test_the_docstring_example(stream_deltas):
    assert stream_deltas(["The", "The en", "The"], 4) == ["", "The", ""]
    assert stream_deltas(["a", "ab", "abc"], 0) == ["a", "b", "c"]  # no stop: nothing held


def test_real_requests(stream_deltas, engine_runs):
    for snapshots, longest in engine_runs:
        deltas = stream_deltas(snapshots, longest)
        assert len(deltas) == len(snapshots)
        assert "".join(deltas) == snapshots[-1], ("the deltas must add up to the final text"
                                                  "\n델타를 이어 붙이면 최종 텍스트가 되어야 "
                                                  "합니다")
        sent = ""
        for k, (delta, text) in enumerate(zip(deltas, snapshots, strict=True)):
            sent += delta
            assert snapshots[-1].startswith(sent), (f"step {k}: sent text that was later cut"
                                                    f"\n스텝 {k}: 나중에 잘리는 텍스트를 "
                                                    "보냈습니다")
            if k < len(snapshots) - 1:  # hold back no more than the stop string needs
                assert len(sent) >= len(text) - max(longest - 1, 0), (
                    f"step {k}: held back"
                    f"\n스텝 {k}: 필요 이상으로 붙잡아 두었습니다")
