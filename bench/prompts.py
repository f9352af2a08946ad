"""Benchmark prompts: generated here from a seed, sized with the server's own tokenizer.

Two machines given the same seed run the same work: every text comes from a generator
driven only by ``random.Random(<string seed>).random()`` (the one part of the standard
library's generator Python promises to keep stable across versions), and is cut to an
exact token count with the tokenizer of the server under test (``/tokenize`` and
``/detokenize``), so "512 input tokens" means 512 for that server.

The generators are streams: the first n units of a longer text are the n units of a
shorter one, so how far a text had to grow before it was cut never changes the result.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.errors import BenchError

# Part of every result's parameters: bump it whenever a generator's output changes, since
# results measured on different prompts do not compare (a unit test pins the streams).
PROMPTS_VERSION = 1


class Tokenizer(Protocol):
    """What sizing needs from a tokenizer: plain text <-> token ids, no special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ChatCounter(Protocol):
    """Counts the tokens of a whole chat prompt as the server renders it."""

    def count_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int: ...


class SeededStream:
    """Deterministic choices from a string seed, using only ``Random.random()``."""

    def __init__(self, *parts: object) -> None:
        self._random = random.Random(":".join(str(p) for p in parts)).random

    def below(self, n: int) -> int:
        return min(int(self._random() * n), n - 1)

    def between(self, low: int, high: int) -> int:
        """An integer in [low, high]."""
        return low + self.below(high - low + 1)

    def choice(self, items: tuple[str, ...] | list[str]) -> str:
        return items[self.below(len(items))]

    def chance(self, p: float) -> bool:
        return self._random() < p


# ---- vocabulary ---------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


NOUNS = _words(
    "cache server request queue token layer model adapter drafter prefix context memory card "
    "stream answer reason tool call file thread worker scheduler block page pool budget kernel "
    "graph batch engine profile manifest lock hash shard tensor weight table report metric "
    "counter window signal harbor river lantern meadow ledger compass falcon glacier orchard"
)
VERBS = _words(
    "keeps reads writes checks counts moves builds splits joins drafts verifies caches streams "
    "loads saves measures plans refuses accepts rejects schedules evicts pins hashes records"
)
ADJECTIVES = _words(
    "quick slow warm cold long short shared private stable pinned exact hybrid dense sparse "
    "linear fixed small large clean honest careful partial empty full recent old"
)
ADVERBS = _words("quietly quickly carefully exactly rarely always often twice early late")
CONNECTIVES = ("and then", "because", "while", "so", "but", "after", "before", "unless", "until")
IDENTIFIERS = tuple(NOUNS[:40])
RANDOM_SYMBOLS = _words(
    ". , ; : ( ) [ ] { } = + - * / % < > ! ? # @ & | ' \" 0 1 2 3 4 5 6 7 8 9 10 42 64 128 256 "
    "1024 _ -> == != <= >= ** //"
)
RANDOM_LEXICON = NOUNS + VERBS + ADJECTIVES + ADVERBS + tuple(w.capitalize() for w in NOUNS) + RANDOM_SYMBOLS


# ---- text streams ------------------------------------------------------------------------


def random_words(stream: SeededStream) -> Iterator[str]:
    """Words and symbols in no order at all, space-separated: the benchmark's "random input tokens"."""
    while True:
        yield stream.choice(RANDOM_LEXICON) + " "


def _sentence(stream: SeededStream) -> str:
    words = [stream.choice(ADJECTIVES), stream.choice(NOUNS), stream.choice(VERBS), "the", stream.choice(NOUNS)]
    if stream.chance(0.5):
        words += [stream.choice(CONNECTIVES), "the", stream.choice(NOUNS), stream.choice(VERBS), stream.choice(ADVERBS)]
    if stream.chance(0.3):
        words += ["with", str(stream.between(2, 4096)), stream.choice(NOUNS) + "s"]
    return " ".join(words).capitalize() + stream.choice((".", ".", ".", "?", "!"))


def prose(stream: SeededStream) -> Iterator[str]:
    """Sentences grouped into paragraphs (blank line every 3-6 sentences)."""
    while True:
        for _ in range(stream.between(3, 6)):
            yield _sentence(stream) + " "
        yield "\n\n"


def _function(stream: SeededStream) -> str:
    name = f"{stream.choice(VERBS)}_{stream.choice(NOUNS)}"
    args = [stream.choice(IDENTIFIERS) for _ in range(stream.between(1, 3))]
    args = list(dict.fromkeys(args))
    lines = [f"def {name}({', '.join(args)}):", f'    """{_sentence(stream)}"""']
    local = stream.choice(IDENTIFIERS) + "_total"
    lines.append(f"    {local} = {stream.between(0, 99)}")
    for _ in range(stream.between(2, 6)):
        kind = stream.below(4)
        arg = stream.choice(args)
        if kind == 0:
            lines.append(f"    for item in {arg}:")
            lines.append(f"        {local} += len(item) * {stream.between(1, 16)}")
        elif kind == 1:
            lines.append(f"    if {arg} is None:")
            lines.append(f'        raise ValueError("{stream.choice(NOUNS)} is missing")')
        elif kind == 2:
            lines.append(f"    {local} = max({local}, {arg}.{stream.choice(VERBS)}({stream.between(1, 512)}))")
        else:
            lines.append(f"    # {_sentence(stream)}")
    lines.append(f"    return {local}")
    return "\n".join(lines) + "\n\n"


def code(stream: SeededStream) -> Iterator[str]:
    """Python-like functions, one unit each."""
    while True:
        yield _function(stream)


def document(stream: SeededStream) -> Iterator[str]:
    """A long mixed document: numbered sections of prose with code listings between."""
    section = 1
    paragraphs = prose(stream)
    while True:
        yield f"## {section}. {stream.choice(ADJECTIVES).capitalize()} {stream.choice(NOUNS)}s\n\n"
        for _ in range(stream.between(2, 8)):
            yield next(paragraphs)
        if stream.chance(0.4):
            yield "```python\n" + _function(stream).rstrip() + "\n```\n\n"
        section += 1


# ---- sizing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sized:
    """A text cut to ``tokens`` tokens (``tokens`` may miss the target: see `fit_tokens`)."""

    text: str
    tokens: int


def fit_tokens(source: Iterator[str], target: int, tokenizer: Tokenizer) -> Sized:
    """The prefix of the text stream ``source`` that the tokenizer counts as exactly ``target`` tokens.

    Grows the text until it holds at least ``target`` tokens, keeps the first ``target``
    ids and decodes them. Re-encoding a cut can merge or split differently at the cut, so
    nearby cut points are tried until one re-encodes to exactly ``target`` tokens.
    """
    if target <= 0:
        return Sized("", 0)
    pieces: list[str] = []
    need = 16
    ids: list[int] = []
    while True:
        while len(pieces) < need:
            pieces.append(next(source))
        ids = tokenizer.encode("".join(pieces))
        if len(ids) >= target + 8:  # slack: the cut may move a few tokens either way
            break
        # Grow to the estimated size (+10 %) at once: a 100k-token document is tokenized
        # a couple of times, never in doubling steps.
        per_unit = max(len(ids), 1) / len(pieces)
        need = max(need + 1, int((target + 8) / per_unit * 1.1) + 1)
    best: Sized | None = None
    tried: set[int] = set()
    cut = target
    for _ in range(24):
        if cut in tried or not 0 < cut <= len(ids):
            break
        tried.add(cut)
        text = tokenizer.decode(ids[:cut])
        count = len(tokenizer.encode(text))
        if count == target:
            return Sized(text, count)
        if count < target and (best is None or count > best.tokens):
            best = Sized(text, count)
        cut += 1 if count < target else -1
    if best is None:
        raise BenchError(f"cannot cut a text to {target} tokens with this tokenizer")
    return best


# ---- chat building blocks ----------------------------------------------------------------

NO_THINKING = {"enable_thinking": False}

AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository and return its text.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or the tests matching a pattern, and return the report.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "timeout_s": {"type": "integer"}},
                "required": [],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression; returns matching lines.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]


def agent_system(stream: SeededStream) -> Iterator[str]:
    """The shared system prompt of the agent workload: rules, conventions, repository files."""
    yield (
        "You are a coding agent working in a Python repository. Read before you write, keep "
        "changes small, run the tests after every change and report what you did.\n\n"
    )
    yield "# Conventions\n\n"
    paragraphs = prose(stream)
    for _ in range(3):
        yield next(paragraphs)
    files = 0
    while True:
        files += 1
        yield f"# File src/{stream.choice(NOUNS)}_{stream.choice(NOUNS)}.py\n\n```python\n"
        for _ in range(stream.between(2, 5)):
            yield _function(stream)
        yield "```\n\n"
        if files % 3 == 0:
            yield next(paragraphs)


@dataclass(frozen=True)
class AgentTurn:
    """One request of a thread: the messages it adds, and the scripted reply kept in history.

    The reply the model generates is measured and then dropped: the next turn carries the
    scripted reply instead, so every server sees exactly the same conversations.
    """

    kind: str  # "code" | "prose" | "tool": what the new message is
    new_messages: list[dict[str, Any]]
    scripted_reply: dict[str, Any]


@dataclass(frozen=True)
class AgentThread:
    index: int
    turns: list[AgentTurn] = field(default_factory=list)

    def request_messages(self, system: str, turn: int) -> list[dict[str, Any]]:
        """The messages of request ``turn``: system, every earlier turn and its reply, this turn."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for earlier in self.turns[:turn]:
            messages += earlier.new_messages
            messages.append(earlier.scripted_reply)
        messages += self.turns[turn].new_messages
        return messages


def _tool_call_reply(stream: SeededStream, thread: int, turn: int) -> tuple[dict[str, Any], str]:
    tool = stream.choice(("read_file", "run_tests", "search_code"))
    if tool == "read_file":
        arguments = {
            "path": f"src/{stream.choice(NOUNS)}_{stream.choice(NOUNS)}.py",
            "start_line": stream.between(1, 400),
        }
    elif tool == "run_tests":
        arguments = {"pattern": f"test_{stream.choice(VERBS)}_{stream.choice(NOUNS)}", "timeout_s": 120}
    else:
        arguments = {"query": f"def {stream.choice(VERBS)}_", "max_results": stream.between(5, 50)}
    call_id = f"call_{thread}_{turn}"
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(arguments)}}
        ],
    }
    return reply, call_id


def agent_thread(
    seed: int, index: int, turns: int, turn_tokens: int, reply_tokens: int, tokenizer: Tokenizer
) -> AgentThread:
    """A thread of ``turns`` requests mixing code, prose and tool results (sizes vary +-50 %)."""
    stream = SeededStream("agent-thread", seed, index)
    out: list[AgentTurn] = []
    pending_call: str | None = None
    for turn in range(turns):
        size = max(16, turn_tokens // 2 + stream.below(turn_tokens + 1))
        part_seed = (seed, index, turn)
        if pending_call is not None:
            kind = "tool"
            body = fit_tokens(code(SeededStream("tool-result", *part_seed)), size, tokenizer).text
            new = [{"role": "tool", "tool_call_id": pending_call, "content": body}]
        elif stream.chance(0.5):
            kind = "code"
            listing = fit_tokens(code(SeededStream("code", *part_seed)), size, tokenizer).text
            ask = _sentence(SeededStream("ask", *part_seed))
            new = [
                {"role": "user", "content": f"Refactor this and keep the behaviour:\n```python\n{listing}\n```\n{ask}"}
            ]
        else:
            kind = "prose"
            text = fit_tokens(prose(SeededStream("prose", *part_seed)), size, tokenizer).text
            new = [{"role": "user", "content": f"{text}\nWhat should we change first, and why?"}]
        pending_call = None
        if turn + 1 < turns and stream.chance(0.4):
            reply, pending_call = _tool_call_reply(stream, index, turn)
        else:
            units = code if kind == "code" else prose
            text = fit_tokens(units(SeededStream("reply", *part_seed)), reply_tokens, tokenizer).text
            reply = {"role": "assistant", "content": text}
        out.append(AgentTurn(kind=kind, new_messages=new, scripted_reply=reply))
    return AgentThread(index=index, turns=out)


SHORT_QUESTION = "In three sentences, what does a prefix cache save, and when does it miss?"
DEPTH_QUESTION = "\n\nSummarise the document above section by section."
COPY_INSTRUCTION = (
    "Reproduce the document below exactly, from its first character to its last, with no "
    "comment before or after it.\n\n<document>\n"
)
COPY_END = "\n</document>"
