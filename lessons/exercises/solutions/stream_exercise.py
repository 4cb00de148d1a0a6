"""Solution to lesson 15's exercise: what a stream may send, step by step."""


def stream_deltas(snapshots: list[str], longest_stop: int) -> list[str]:
    holdback = max(longest_stop - 1, 0)
    deltas, sent = [], 0
    for i, text in enumerate(snapshots):
        final = i == len(snapshots) - 1
        end = len(text) if final else max(sent, len(text) - holdback)
        deltas.append(text[sent:end])
        sent = end
    return deltas
