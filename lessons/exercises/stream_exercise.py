"""Exercise (lesson 15, "Serving it"): what a stream may send, step by step.

The engine reports a request's whole text after every step (``RequestOutput.outputs[0].text``,
cumulative). A streaming server sends only what is new. One catch: when a stop string
completes, the engine cuts it out of the text, and the last snapshot is *shorter* than the one
before. Text already sent cannot be taken back, so while the request runs the server holds back
the last ``longest_stop - 1`` characters: they might be the start of a stop string.

Write ``stream_deltas``: given the snapshots of one request (the last one is the final text,
after the request finished) and the length of its longest stop string (0 when it has none),
return the text sent after each snapshot, one string per snapshot (empty when nothing may be
sent yet). Check your work with

    pytest lessons/exercises/test_stream_exercise.py

The test runs the tiny model with stop strings step by step and checks that your deltas add up
to the final text, never send a character that is later cut, and hold back no more than
needed. Until you edit this file the test reports your version as skipped and checks only the
solution.
"""


def stream_deltas(snapshots: list[str], longest_stop: int) -> list[str]:
    """The delta sent after each snapshot; ''.join(result) == snapshots[-1].

    Example: snapshots ["The", "The en", "The"], one stop string " end" (4 characters,
    3 held back): after "The" nothing is safe (""); after "The en", the first 3 characters
    ("The"); the request then finished with " end" cut: the rest of "The" is "".
    """
    # While running (every snapshot but the last): everything up to len(text) - (longest_stop
    # - 1) is safe; never move backwards (a snapshot may be no longer than the last).
    # The last snapshot is final: send the rest of it.
    raise NotImplementedError("exercise: implement stream_deltas")
