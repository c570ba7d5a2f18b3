"""What every parser of node output shares: its one error type and the guard that keeps it the only one.

Node output is untrusted (a broken tool, a truncated stream, a hostile host): a parser returns its
fact, or raises ParseError with a short reason, and never any other exception. `guard` enforces that
(and refuses oversized input) for `facts` (the node facts probe) and `docker_parse` (Docker's output).
`parse_json` is the one reader of JSON that a node, a container or the head's API sent: json.loads raises
RecursionError, not ValueError, on `[[[[...` nested a thousand deep, and a document that does parse a few
hundred deep breaks whatever prints or dumps it later; parse_json refuses both with ParseError.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

MAX_INPUT_CHARS: Final = 8 * 1024 * 1024
"""Anything longer is refused: no real probe output comes near it, and parsing it would cost memory."""

MAX_JSON_DEPTH: Final = 64
"""Deeper JSON is refused: nothing sparkctl reads nests beyond a dozen levels, and walking a deep document
(json.dumps, repr, a recursive rule) would reach Python's recursion limit far from where it was parsed."""

_NOT_BRACKET: Final = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_STEP: Final = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}

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


def _too_deep(text: str) -> bool:
    """Whether `text` nests arrays and objects deeper than MAX_JSON_DEPTH (exact for valid JSON: brackets
    inside strings do not count). Fewer opening brackets than that cannot: most documents stop there."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    unescaped = text.replace("\\\\", "").replace('\\"', "")  # left to right, as JSON reads escapes
    outside = "".join(unescaped.split('"')[::2])  # every other piece lies outside the strings
    brackets = outside.encode("ascii", "ignore").translate(None, _NOT_BRACKET)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) > MAX_JSON_DEPTH


class NotJson(ParseError):
    """What parse_json raises: `reason` is the short why (json's own message, or the nesting)."""

    def __init__(self, reason: str, where: str = "") -> None:
        super().__init__(f"not JSON: {reason}{where}")
        self.reason = reason


def parse_json(text: str | bytes | bytearray) -> Any:
    """The JSON value of untrusted text (bytes: in the encodings json.loads accepts), or NotJson (a
    ParseError): never RecursionError, UnicodeDecodeError or any other exception, and never a value nested
    deeper than MAX_JSON_DEPTH."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode(json.detect_encoding(text))
        if not isinstance(text, str):
            raise NotJson(f"expected text, got {type(text).__name__}")
        if _too_deep(text):
            raise NotJson(f"nested too deeply (more than {MAX_JSON_DEPTH} levels)")
        return json.loads(text)
    except ParseError:
        raise
    except json.JSONDecodeError as exc:
        raise NotJson(exc.msg, f" at character {exc.pos}") from None
    except UnicodeDecodeError as exc:
        raise NotJson(f"not valid {exc.encoding}", f" at byte {exc.start}") from None
    except ValueError as exc:  # a number of more digits than int() takes
        raise NotJson(str(exc)[:200]) from None
    except RecursionError:  # unbalanced brackets the depth count underrated
        raise NotJson("nested too deeply") from None
