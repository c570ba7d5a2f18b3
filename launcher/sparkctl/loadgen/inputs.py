"""What a run sends: the workloads (built-in prompt sets, a prompt file), the sampling
defaults of the model card's benchmark and `--concurrency`'s list (where it goes: headapi.Endpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..facts.parsing import ParseError, parse_json

DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_WORKLOADS = ("prose", "code", "list")
TEMPERATURE = 0.6
TOP_P = 0.95

# Several prompts per workload, each opening with different words, and every request is prefixed
# with a tag unique to it: no two requests share a prefix-cache block, which would flatter TTFT.
PROMPTS: dict[str, tuple[str, ...]] = {
    "prose": (
        "Write an essay about the history of lighthouses and the keepers who lived in them.",
        "Describe a long walk through a rainy city at night, in flowing literary prose.",
        "Tell the story of a baker who finds a forgotten family recipe in an old tin box.",
        "Explain to a curious teenager why the sky turns orange and red at sunset.",
        "Compose a letter from a sailor to his sister about a winter spent at sea.",
        "Reflect, in a personal essay, on what makes a small town feel like home.",
        "Narrate the first warm day of spring in a mountain village, from dawn to dusk.",
        "Argue in a persuasive essay for keeping public libraries open late at night.",
    ),
    "code": (
        "Write a Python module implementing an LRU cache class with get, put and resize, with tests.",
        "Implement in Rust a tokenizer for arithmetic expressions and a recursive-descent parser.",
        "Create a TypeScript React component for a sortable, paginated data table with filtering.",
        "Give a C function that parses an IPv4 CIDR string and checks whether an address is inside it.",
        "Produce a Go HTTP server with a rate limiter middleware (token bucket) and graceful shutdown.",
        "Build a SQL schema for a library lending system and the queries for overdue books.",
        "Port this idea to Java: a thread-safe bounded blocking queue using locks and conditions.",
        "Design a bash script that rotates log files by size, compresses old ones and keeps ten.",
    ),
    "list": (
        "List forty common kitchen herbs and spices, each with one typical dish that uses it.",
        "Enumerate thirty famous bridges of the world with their city and year of completion.",
        "Give a numbered list of fifty English words that describe weather, one per line.",
        "Name thirty board games with the number of players and a one-line description each.",
        "Make a checklist of forty things to pack for a two-week hiking trip in the mountains.",
        "Provide a list of thirty-five programming languages with the year each first appeared.",
        "Catalogue thirty rivers of Europe with the countries each one flows through.",
        "Outline forty tasks for spring cleaning a house, grouped by room, as a bulleted list.",
    ),
}
WARMUP_PROMPT = "Warm-up request: say a few words about the weather today."


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]


def builtin_workload(name: str) -> Workload:
    if name not in PROMPTS:
        raise UsageError(f"unknown workload {name!r}", fix=f"use one of: {', '.join(PROMPTS)} (or --prompt-file)")
    return Workload(name, PROMPTS[name])


def load_prompt_file(path: str | os.PathLike[str]) -> Workload:
    """Prompts from a file: one per non-empty line, or for *.jsonl one JSON string / {"prompt": ...} per line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"prompt file {p}: cannot be read ({exc})") from None
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                item = parse_json(line)
            except ParseError as exc:
                raise UsageError(f"prompt file {p}, line {n}: {exc}",
                                 fix='write one JSON string or {"prompt": "..."} per line') from None
            item = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(item, str) or not item.strip():
                raise UsageError(f"prompt file {p}, line {n}: expected a string or an object with a 'prompt' string")
            prompts.append(item)
        else:
            prompts.append(line.strip())
    if not prompts:
        raise UsageError(f"prompt file {p} holds no prompts", fix="write one prompt per line")
    return Workload(p.stem or "file", tuple(prompts))


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: positive, distinct, kept in the given order."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise UsageError(f"{what} {text!r}: {part!r} is not a positive whole number", fix="e.g. 1,2,4,8")
        if int(part) in out:
            raise UsageError(f"{what} {text!r}: {part} is listed twice")
        out.append(int(part))
    if not out:
        raise UsageError(f"{what} is empty", fix="e.g. 1,2,4,8")
    return out
