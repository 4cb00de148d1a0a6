"""benchmarks/progress.py: the benchmarks' progress bars draw on a terminal and stay silent in CI
logs and pipes, by one rule; forced on, a script's bars appear on stderr and leave its stdout
alone."""

import io
import os

import pytest

from pagedllm.benchmarks import progress as bars
from pagedllm.benchmarks import step_overhead


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what is drawn on it."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def clean_env(monkeypatch):
    """Neither CI nor the override set, whatever the environment running the tests says."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(bars.ENV, raising=False)
    return monkeypatch


@pytest.fixture
def pty_stream():
    """The follower end of a pseudo-terminal: isatty() is the operating system's answer."""
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    stream = os.fdopen(follower, "w")
    yield stream
    stream.close()
    os.close(leader)


@pytest.mark.parametrize(("env", "tty", "shown"), [
    ({}, True, True),  # a terminal, not CI: drawn
    ({}, False, False),  # a file or a pipe (a CI log): silent
    ({"CI": "true"}, True, False),  # CI: silent, even on a terminal
    ({"CI": "1"}, True, False),
    ({"CI": "false"}, True, True),  # CI=false / empty: not CI
    ({"CI": ""}, True, True),
    ({bars.ENV: "0"}, True, False),  # the override, both ways, over everything else
    ({bars.ENV: "1"}, False, True),
    ({bars.ENV: "1", "CI": "true"}, False, True),
    ({bars.ENV: "off", "CI": "true"}, True, False),
])
def test_the_rule(env, tty, shown):
    stream = Terminal() if tty else io.StringIO()
    assert bars.enabled(stream, environ=env) is shown


def test_a_pseudo_terminal_shows_the_bars_unless_ci_is_set(clean_env, pty_stream):
    assert pty_stream.isatty()
    assert bars.enabled(pty_stream)
    assert not bars.progress(range(3), "tty", stream=pty_stream).disable
    clean_env.setenv("CI", "true")
    assert not bars.enabled(pty_stream)
    assert bars.progress(range(3), "ci", stream=pty_stream).disable


def test_streams_that_are_not_terminals_are_silent(clean_env):
    for stream in (io.StringIO(), object()):  # a file, a pipe; something with no isatty
        assert not bars.enabled(stream)
    closed = io.StringIO()
    closed.close()  # isatty() on a closed stream raises ValueError
    assert not bars.enabled(closed)


def test_progress_draws_on_a_terminal_and_passes_the_items_through(clean_env):
    terminal, log = Terminal(), io.StringIO()
    assert list(bars.progress(range(3), "counting", stream=terminal)) == [0, 1, 2]
    assert list(bars.progress(range(3), "counting", stream=log)) == [0, 1, 2]
    assert "counting" in terminal.getvalue() and "/3" in terminal.getvalue()
    assert log.getvalue() == ""
    with bars.progress(None, "by hand", total=4, stream=terminal) as bar:
        bar.update(4)
    assert "by hand" in terminal.getvalue()


def test_progress_defaults_to_stderr(clean_env, capsys):
    list(bars.progress(range(2), "quiet"))  # pytest's captured stderr is no terminal
    assert capsys.readouterr().err == ""
    clean_env.setenv(bars.ENV, "1")
    list(bars.progress(range(2), "forced"))
    assert "forced" in capsys.readouterr().err


def test_say_prints_what_print_prints_with_a_bar_drawn(clean_env, capsys):
    clean_env.setenv(bars.ENV, "1")
    with bars.progress(None, "running", total=2) as bar:
        bar.update()
        bars.say("  a line", 2, "of text")
        bar.update()
    out = capsys.readouterr()
    print("  a line", 2, "of text")
    assert out.out == capsys.readouterr().out == "  a line 2 of text\n"
    assert "running" in out.err


def test_a_scripts_progress_appears_when_forced_on_and_stays_off_stdout(clean_env, capsys):
    argv = ["--seqs", "1,2", "--steps", "2", "--tiers", "reference"]
    clean_env.setenv("CI", "true")  # CI: silent
    quiet = step_overhead.main(argv)
    silent = capsys.readouterr()
    assert silent.err == ""
    clean_env.setenv(bars.ENV, "1")  # forced on, CI or not
    shown = step_overhead.main(argv)
    drawn = capsys.readouterr()
    assert "sizes x tiers" in drawn.err and "/2" in drawn.err
    # The bars draw on stderr only: stdout is the same table (timings aside), no bar in it.
    assert "sizes x tiers" not in drawn.out and "\r" not in drawn.out
    assert drawn.out.splitlines()[0] == silent.out.splitlines()[0]
    assert len(drawn.out.splitlines()) == len(silent.out.splitlines()) == 3
    assert [(r["tier"], r["seqs"]) for r in shown] == [(r["tier"], r["seqs"]) for r in quiet]
