"""Checks of the values a user hands in, each answering with what was wrong and what is right.

Shared by SamplingParams, BeamSearchParams and the engine's door, so every tier refuses the
same input with the same words. A wrong type is a TypeError (bool is not accepted where an
integer is meant: True is an int to Python, not to a user); a value outside its range is a
ValueError naming the field and the range.
"""

import math


class FieldValueError(ValueError):
    """A value outside what is accepted. ``field`` names the request or engine field it is
    about, so a server can answer "400, field X" without reading the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # pickled and copied with its field (a worker's error crosses)
        return type(self), (self.field, str(self))


class FieldTypeError(TypeError):
    """A value of the wrong type; ``field`` as in FieldValueError."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return type(self), (self.field, str(self))


def check_int(name: str, value, low: int | None = None, high: int | None = None,
              allowed: tuple = ()) -> None:
    """value is an int (not a bool) with low <= value <= high, or one of allowed."""
    if value in allowed and isinstance(value, int) and not isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldTypeError(name, f"{name} must be an integer, got {value!r} "
                             f"({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            limit = f">= {low}"
        elif low is None:
            limit = f"<= {high}"
        else:
            limit = f"in [{low}, {high}]"
        either = "".join(f"{a} or " for a in allowed)
        raise FieldValueError(name, f"{name} must be {either}{limit}, got {value}")


def check_float(name: str, value, low: float, high: float = math.inf, *,
                low_open: bool = False) -> None:
    """value is a finite real number with low <= value <= high (low < value if low_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldTypeError(name, f"{name} must be a number, got {value!r} "
                             f"({type(value).__name__})")
    if not math.isfinite(value):
        raise FieldValueError(name, f"{name} must be a finite number, got {value}")
    if value < low or (low_open and value == low) or value > high:
        if math.isfinite(high):
            limit = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        else:
            limit = f"{'>' if low_open else '>='} {low:g}"
        raise FieldValueError(name, f"{name} must be {limit}, got {value}")


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """A list of token ids inside the vocabulary (ints, not strings or floats)."""
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise FieldTypeError(name, f"{name} must be a list of token ids (integers), "
                             f"got {ids!r}")
    ids = list(ids)
    wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
    if wrong:
        raise FieldTypeError(name, f"{name} must hold integer token ids, got {wrong[0]!r} "
                             f"({type(wrong[0]).__name__}); e.g. [1, 2, 3]")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise FieldValueError(name, f"{name}: token ids {bad[:5]} are outside the vocabulary; "
                              f"valid ids are 0..{vocab_size - 1}")
    return ids


def check_bool(name: str, value) -> None:
    """value is True or False (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise FieldTypeError(name, f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    """value is one of choices."""
    if value not in choices:
        raise FieldValueError(name, f"{name} {value!r} is unknown; choose one of {choices}")


def check_names(name: str, value, example: str) -> tuple[str, ...]:
    """A list of non-empty strings, as a tuple; None is no names (as ``stop=None`` is no stop
    string). One string is refused rather than read as its letters or as a list of one: the
    field holds a list, and a bare string is likelier a mistake for one (example shows one)."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise FieldTypeError(name, f"{name} must be a list of names, e.g. {example}, got "
                             f"{value!r} ({type(value).__name__})")
    names = tuple(value)
    wrong = [v for v in names if not isinstance(v, str)]
    if wrong:
        raise FieldTypeError(name, f"{name} must hold names (strings), e.g. {example}, got "
                             f"{wrong[0]!r} ({type(wrong[0]).__name__})")
    if any(not v.strip() for v in names):
        raise FieldValueError(name, f"{name} must hold non-empty names, e.g. {example}, got "
                              f"{list(names)!r}")
    return names
