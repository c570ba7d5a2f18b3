"""The wire formats the load generator reads: HTTP/1.1 chunked bodies, server-sent events, and the
spec-decode counters of the server's /metrics (vLLM's names: engine_lines).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..facts.engine_lines import (  # vLLM's metric names, in one place
    SPEC_ACCEPTED,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
)
from ..facts.promtext import Sample, total
from ..measure import metrics as benchmetrics


class ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding (uvicorn, i.e. vLLM, streams this way)."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # bytes still due in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is still due
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        i = 0
        while not self.done:
            if self._left:
                piece = buf[i:i + self._left]
                out.append(piece)
                self._left -= len(piece)
                i += len(piece)
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if len(buf) - i < 2:
                    break
                i += 2
                self._crlf = False
            j = buf.find(b"\r\n", i)
            if j < 0:
                if len(buf) - i > 1024:
                    raise ValueError("chunk size line longer than 1 KiB")
                break
            try:
                size = int(buf[i:j].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError(f"bad chunk size line {buf[i:j][:40]!r}") from None
            i = j + 2
            if size == 0:
                self.done = True  # trailers, if any, are ignored
            self._left = size
        self._buf = buf[i:]
        return b"".join(out)


class SSEParser:
    """Server-sent events -> the data payload of each event (bytes). Other fields and comments are ignored.

    feed() splits events one by one; feed_bulk() only cuts the input at the last complete event and
    hands back that region whole, for callers that scan it with C-speed searches instead of a loop.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        return self.split(self.feed_bulk(data))

    def feed_bulk(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:  # CRLF line ends: normalise, keeping a trailing CR until its LF arrives
            tail = b"\r" if buf.endswith(b"\r") else b""
            buf = buf[:len(buf) - len(tail)].replace(b"\r\n", b"\n")
        else:
            tail = b""
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._buf = buf + tail
            return b""
        self._buf = buf[cut + 2:] + tail
        return buf[:cut + 2]

    @staticmethod
    def split(region: bytes) -> list[bytes]:
        """The data payloads of the complete events in `region`."""
        events: list[bytes] = []
        for block in region.split(b"\n\n"):
            if block.startswith(b"data: ") and b"\n" not in block:  # the usual one-line event
                events.append(block[6:])
                continue
            lines = [ln[5:] for ln in block.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                events.append(b"\n".join(ln[1:] if ln.startswith(b" ") else ln for ln in lines))
        return events


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float | None
    accepted: float


@dataclass(frozen=True)
class SpecDelta:
    drafts: float
    draft_tokens: float | None
    accepted: float

    @property
    def accepted_per_step(self) -> float | None:
        return self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        """1 + accepted ÷ drafts: each step adds its accepted draft tokens to the one it samples."""
        a = self.accepted_per_step
        return None if a is None else 1.0 + a

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None


def spec_counters(samples: Sequence[Sample], model: str | None = None) -> SpecCounters | None:
    """The spec-decode counters among /metrics' samples (promtext.parse), summed over engines and ranks."""
    drafts = total(samples, SPEC_DRAFTS, model)
    accepted = total(samples, SPEC_ACCEPTED, model)
    if drafts is None or accepted is None:
        return None
    return SpecCounters(drafts, total(samples, SPEC_DRAFT_TOKENS, model), accepted)


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecDelta | None:
    if before is None or after is None:
        return None
    dt = None if before.draft_tokens is None or after.draft_tokens is None else after.draft_tokens - before.draft_tokens
    return SpecDelta(after.drafts - before.drafts, dt, after.accepted - before.accepted)


percentile = benchmetrics.percentile  # q-th percentile (0..100), numpy's linear default; None when empty
