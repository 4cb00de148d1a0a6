"""Progress bars for the benchmarks' long loops: drawn on a terminal, silent in CI logs.

Every bar is a tqdm (as ``LLM.generate(use_tqdm=...)`` draws one) made by ``progress``, which
decides whether it draws by one rule (``enabled``), the same in every script:

1. ``PAGEDLLM_PROGRESS`` set to 1 (or true, yes, on) draws the bars, to 0 (false, no, off) never
   does, whatever else holds;
2. otherwise ``CI`` set (to anything but empty, 0 or false: CI services set CI=true) keeps them
   silent;
3. otherwise they draw when the stream they draw on (stderr) is a terminal, and are silent
   when it is a file or a pipe.

The bars draw on stderr and clear themselves when done, so stdout (the tables, the lines each
script prints as it goes) and the JSON are the same with and without them. A line printed while
a bar is drawn goes through ``say``: it lifts the bar, prints the line and draws the bar again
below it.
"""

import os
import sys
from collections.abc import Iterable, Mapping
from typing import IO, Any

from tqdm import tqdm

ENV = "PAGEDLLM_PROGRESS"
YES = ("1", "true", "yes", "on")
NO = ("0", "false", "no", "off")


def enabled(stream: IO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a bar drawn on `stream` (default: sys.stderr) shows, under `environ` (default:
    os.environ): the rule of this module's docstring."""
    environ = os.environ if environ is None else environ
    forced = environ.get(ENV, "").strip().lower()
    if forced in YES:
        return True
    if forced in NO:
        return False
    if environ.get("CI", "").strip().lower() not in ("", *NO):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(iterable: Iterable | None = None, desc: str | None = None,
             total: float | None = None, *, stream: IO | None = None, **options: Any) -> tqdm:
    """A tqdm over `iterable` (or, without one, a bar to ``update`` by hand up to `total`),
    drawn on `stream` (default: sys.stderr) when ``enabled(stream)`` says so and a no-op
    otherwise; it clears itself when done. `options` go to tqdm (unit, leave, ...)."""
    stream = sys.stderr if stream is None else stream
    options = {"leave": False, "dynamic_ncols": True, **options}
    return tqdm(iterable, desc=desc, total=total, file=stream, disable=not enabled(stream),
                **options)


def say(*values: object, sep: str = " ") -> None:
    """print(*values) to stdout, flushed, without tearing a bar that is being drawn."""
    tqdm.write(sep.join(str(v) for v in values), file=sys.stdout)
    sys.stdout.flush()
