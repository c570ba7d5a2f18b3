"""What every parser of node output shares: its one error type and the guard that keeps it the only one.

Node output is untrusted (a broken tool, a truncated stream, a hostile host): a parser returns its
fact, or raises ParseError with a short reason, and never any other exception. `guard` enforces that
(and refuses oversized input) for `facts` (the node facts probe) and `docker_parse` (Docker's output).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

MAX_INPUT_CHARS: Final = 8 * 1024 * 1024
"""Anything longer is refused: no real probe output comes near it, and parsing it would cost memory."""

P = ParamSpec("P")
R = TypeVar("R")


class ParseError(ValueError):
    """The output was not what the tool prints; the message says what was wrong with it."""


def guard(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn any failure while parsing untrusted text into ParseError (and refuse oversized input)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        text = args[0] if args else None
        if isinstance(text, str) and len(text) > MAX_INPUT_CHARS:
            raise ParseError(f"output too large ({len(text)} characters)")
        if text is not None and not isinstance(text, str):
            raise ParseError(f"expected text, got {type(text).__name__}")
        try:
            return fn(*args, **kwargs)
        except ParseError:
            raise
        except (
            ValueError,
            KeyError,
            TypeError,
            IndexError,
            AttributeError,
            RecursionError,
            OverflowError,
        ) as exc:
            raise ParseError(
                f"{fn.__name__}: unexpected output ({type(exc).__name__}: {exc})"[:300]
            ) from None

    return wrapper


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(f"not JSON: {exc.msg} at character {exc.pos}") from None
