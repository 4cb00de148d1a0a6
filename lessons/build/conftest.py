"""What the build-it track's tests share: every test runs on the solutions and on your files.

A test module names its piece, e.g. ``PIECE = "block_manager"``, and asks for fixtures:

- ``impl``: that piece's module, the solution's or yours;
- ``parts``: every piece (build_types.Parts). On the solution side all are the solutions'. On
  your side the piece under test is yours, and every other piece is yours once you have
  written it, the solution's until then (the summary at the end of the run says which).
  ``PREFIX_CACHING = True`` in the module: your block manager counts as written only once it
  also takes a prefix cache (milestone 4).

Both are parametrized by ``side``, so each test runs twice. While your piece still raises
NotImplementedError, the test is skipped on your side (the skip names what to write); on the
solution side the same error is a failure.
"""

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import build_track  # noqa: E402

NOT_WRITTEN = "not written yet"


@pytest.fixture(params=["solution", "yours"])
def side(request) -> str:
    return request.param


@pytest.fixture
def impl(side, request):
    return build_track.load(request.module.PIECE, side)


@pytest.fixture
def parts(side, request):
    piece = request.module.PIECE
    prefix = getattr(request.module, "PREFIX_CACHING", False)
    return build_track.compose(side, own=piece, prefix_caching=prefix)


@pytest.fixture(scope="module")
def one_thread():
    """Model runs on one torch thread: the machine is shared, and the model is tiny."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """NotImplementedError on your side: not written yet, so a skip, not a failure."""
    try:
        return (yield)
    except NotImplementedError as err:
        params = getattr(getattr(pyfuncitem, "callspec", None), "params", {})
        if params.get("side") == "yours":
            piece = pyfuncitem.module.PIECE
            where = build_track.piece_path(piece, "yours").relative_to(HERE.parent.parent)
            pytest.skip(f"{NOT_WRITTEN} ({where}): {err} / 아직 작성하지 않음 ({where})")
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Report such a skip at the test's own line, not at this file's."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple) and NOT_WRITTEN in str(
            report.longrepr[2]):
        path, line = item.reportinfo()[:2]
        report.longrepr = (str(path), line + 1, report.longrepr[2])
    return report


def pytest_terminal_summary(terminalreporter):
    if build_track.USED:
        terminalreporter.write_sep("-", "build-it track: the other pieces your tests ran on")
        for piece, origin in sorted(build_track.USED.items(),
                                    key=lambda item: build_track.PIECES[item[0]]):
            terminalreporter.write_line(f"{build_track.PIECES[piece]}. {piece}: {origin}")
