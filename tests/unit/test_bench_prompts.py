"""Benchmark prompts: deterministic from the seed, cut to exact token counts by a real
tokenizer (the tiny model's byte-level BPE, as the CPU server loads it), and shaped as each
workload promises (shared agent prefix, tool turns, sizes)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import prompts, workloads
from bench.workloads import WORKLOADS, Context, params_from_args
from core.errors import BenchError

REPO = Path(__file__).resolve().parents[2]


class LocalTokenizer:
    """The tiny model's tokenizer and chat template, used as the server uses them."""

    def __init__(self, hf) -> None:
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def count_chat(self, messages, tools=None) -> int:
        return len(
            self.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                enable_thinking=False,
            )["input_ids"]
        )


@pytest.fixture(scope="module")
def tok() -> LocalTokenizer:
    from prepare.generate import DEFAULT_SEED
    from prepare.tokenizer import build_tokenizer

    return LocalTokenizer(build_tokenizer(DEFAULT_SEED))


def _ctx(tok, seed: int = 0, max_model_len: int | None = None) -> Context:
    return Context(model="m", seed=seed, tokenizer=tok, cache_salt="s", max_model_len=max_model_len)


def _first(units, n: int = 200) -> str:
    return "".join(itertools.islice(units, n))


# The generators define the benchmark's work: changing one changes every result. These
# digests pin them; if you change a generator on purpose, bump PROMPTS_VERSION and update.
PINNED = {
    "random_words": "74a372c6",
    "prose": "62e71e66",
    "code": "eefb1d28",
    "document": "5e56c716",
}


def _digest(name: str) -> str:
    units = getattr(prompts, name)(prompts.SeededStream("pinned", 0))
    return hashlib.sha256(_first(units).encode()).hexdigest()[:8]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_text_streams_are_pinned_to_the_prompts_version(name):
    assert prompts.PROMPTS_VERSION == 1
    assert _digest(name) == PINNED[name], f"the {name} generator changed: bump PROMPTS_VERSION and re-pin"


def test_streams_do_not_depend_on_the_interpreter_hash_seed():
    code = (
        "from bench import prompts; import itertools; "
        "print(''.join(itertools.islice(prompts.document(prompts.SeededStream('x', 3)), 50)))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": str(h)},
        ).stdout
        for h in (1, 2)
    }
    assert len(outs) == 1 and len(next(iter(outs))) > 1000


def test_same_seed_same_text_other_seed_other_text():
    a = _first(prompts.prose(prompts.SeededStream("w", 1)))
    assert a == _first(prompts.prose(prompts.SeededStream("w", 1)))
    assert a != _first(prompts.prose(prompts.SeededStream("w", 2)))


def test_a_longer_stream_starts_with_the_shorter_one():
    short = _first(prompts.code(prompts.SeededStream("w", 5)), 10)
    assert _first(prompts.code(prompts.SeededStream("w", 5)), 40).startswith(short)


@pytest.mark.parametrize("generator", ["random_words", "prose", "code", "document"])
@pytest.mark.parametrize("target", [1, 7, 64, 513, 2048])
def test_fit_tokens_cuts_to_the_exact_count(tok, generator, target):
    units = getattr(prompts, generator)
    sized = prompts.fit_tokens(units(prompts.SeededStream("fit", target)), target, tok)
    assert sized.tokens == target
    assert len(tok.encode(sized.text)) == target


def test_fit_tokens_does_not_depend_on_how_far_the_text_grew(tok):
    """The cut of a stream is its own prefix: a bigger first guess gives the same text."""
    first = prompts.fit_tokens(prompts.prose(prompts.SeededStream("g", 0)), 300, tok)
    whole = _first(prompts.prose(prompts.SeededStream("g", 0)), 2000)
    assert whole.startswith(first.text)


def test_a_long_text_is_sized_in_a_few_tokenizer_calls_without_overshooting(tok):
    """A 100k-token depth document goes through /tokenize a handful of times, not dozens."""
    sizes: list[int] = []

    class Counting(LocalTokenizer):
        def encode(self, text: str) -> list[int]:
            ids = super().encode(text)
            sizes.append(len(ids))
            return ids

    sized = prompts.fit_tokens(prompts.document(prompts.SeededStream("long", 0)), 20000, Counting(tok.hf))
    assert sized.tokens == 20000
    assert len(sizes) <= 6 and max(sizes) < 1.3 * 20000, sizes


def test_random_words_are_separate_words():
    words = _first(prompts.random_words(prompts.SeededStream("w", 0)), 50).split()
    assert len(words) == 50 and set(words) <= set(prompts.RANDOM_LEXICON)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_builds_the_same_requests_from_the_same_seed(tok, name):
    workload = WORKLOADS[name]
    small = {
        "c1": {"input_tokens": 40, "output_tokens": 8, "requests": 2},
        "c8": {"input_tokens": 40, "output_tokens": 8, "requests": 3, "concurrency": (1, 2)},
        "agent": {"system_tokens": 200, "threads": (2,), "turns": 3, "turn_tokens": 60, "output_tokens": 20},
        "users": {"system_tokens": 200, "prompt_tokens": 60, "output_tokens": 20, "concurrency": (1, 2), "rounds": 2},
        "depth": {"depths": (0, 100, 300), "output_tokens": 8},
        "copy": {"document_tokens": 150},
        "image": {"width": 16, "height": 16, "requests": 2, "output_tokens": 4},
    }[name]
    params = params_from_args(workload, small)

    def bodies(seed: int) -> str:
        points = workload.build(params, _ctx(tok, seed))
        return json.dumps([[[spec.body for spec in job] for job in p.jobs] for p in points], sort_keys=True)

    assert bodies(0) == bodies(0)
    assert bodies(0) != bodies(1)


def test_published_sizes_are_the_defaults():
    assert params_from_args(WORKLOADS["c1"], {}) == workloads.C1Params(512, 2048, 5)
    c8 = params_from_args(WORKLOADS["c8"], {})
    assert (c8.input_tokens, c8.output_tokens, c8.requests, c8.concurrency) == (1024, 256, 32, (8,))
    agent = params_from_args(WORKLOADS["agent"], {})
    assert agent.system_tokens == 5800 and 4 <= agent.threads[0] <= 12
    users = params_from_args(WORKLOADS["users"], {})
    assert (users.system_tokens, users.prompt_tokens, users.output_tokens, users.concurrency) == (
        5800, 1000, 256, (8, 32, 64))
    assert params_from_args(WORKLOADS["depth"], {}).depths == (0, 10000, 43000, 100000)
    assert params_from_args(WORKLOADS["copy"], {}).document_tokens == 25000


def test_c1_prompts_have_the_requested_size_and_fixed_output(tok):
    points = workloads.build_c1(workloads.C1Params(input_tokens=96, output_tokens=12, requests=3), _ctx(tok))
    specs = points[0].jobs[0]
    assert len(specs) == 3 and points[0].concurrency == 1
    for spec in specs:
        assert len(tok.encode(spec.body["messages"][0]["content"])) == 96
        assert spec.body["max_tokens"] == 12 and spec.body["ignore_eos"] is True
        assert spec.body["temperature"] == 0
        assert spec.body["chat_template_kwargs"] == {"enable_thinking": False}
        assert spec.expected_prompt_tokens == tok.count_chat(spec.body["messages"])
    assert len({s.body["messages"][0]["content"] for s in specs}) == 3


def test_agent_threads_share_the_system_prompt_and_extend_their_own_history(tok):
    params = workloads.AgentParams(system_tokens=300, threads=(3,), turns=4, turn_tokens=80, output_tokens=30)
    [point] = workloads.build_agent(params, _ctx(tok))
    assert point.concurrency == 3 and len(point.jobs) == 3
    system = {job[0].body["messages"][0]["content"] for job in point.jobs}
    assert len(system) == 1 and len(tok.encode(system.pop())) == 300
    assert len({spec.body["cache_salt"] for job in point.jobs for spec in job}) == 1  # one shared prefix
    for job in point.jobs:
        for earlier, later in itertools.pairwise(job):
            # Each request repeats the previous one's messages: the thread's prefix is cacheable.
            assert later.body["messages"][: len(earlier.body["messages"])] == earlier.body["messages"]
            assert later.expected_prompt_tokens > earlier.expected_prompt_tokens
        assert all(spec.body["tools"] == prompts.AGENT_TOOLS for spec in job)


def test_users_points_keep_n_users_busy_on_one_shared_system_prompt(tok):
    """C8/C32/C64 at tiny size: a point per concurrency, n users each sending `rounds` requests
    one after the other; every request is the shared system prompt, the tools and one medium
    message of its own, and the prefix is shared within a point, never across points."""
    params = workloads.UsersParams(system_tokens=300, prompt_tokens=80, output_tokens=30, concurrency=(2, 5), rounds=3)
    points = workloads.build_users(params, _ctx(tok))
    assert [(p.label, p.concurrency, len(p.jobs)) for p in points] == [("concurrency 2", 2, 2), ("concurrency 5", 5, 5)]
    specs = [spec for p in points for job in p.jobs for spec in job]
    assert all(len(job) == 3 for p in points for job in p.jobs)
    systems = {spec.body["messages"][0]["content"] for spec in specs}
    assert len(systems) == 1 and len(tok.encode(system := systems.pop())) == 300
    shared = tok.count_chat([{"role": "system", "content": system}], prompts.AGENT_TOOLS)
    assert all([m["role"] for m in spec.body["messages"]] == ["system", "user"] for spec in specs)
    assert all(spec.body["tools"] == prompts.AGENT_TOOLS and spec.body["max_tokens"] == 30 for spec in specs)
    for point in points:
        own = [spec.body["messages"][1]["content"] for job in point.jobs for spec in job]
        assert len(set(own)) == len(own)  # no two requests of a point are the same
        assert len({spec.body["cache_salt"] for job in point.jobs for spec in job}) == 1
        # medium messages: 80 tokens +-50 % of content, plus the code/prose framing
        assert all(40 <= spec.expected_prompt_tokens - shared <= 200 for job in point.jobs for spec in job)
    assert points[0].jobs[0][0].body["cache_salt"] != points[1].jobs[0][0].body["cache_salt"]
    # a smaller point sends the first requests of the larger one
    assert points[0].jobs[1][2].body["messages"] == points[1].jobs[1][2].body["messages"]


def test_users_refuses_an_unknown_tool_choice(tok):
    with pytest.raises(BenchError, match="--tool-choice 'required': use auto or none"):
        params = workloads.UsersParams(system_tokens=50, prompt_tokens=20, tool_choice="required")
        workloads.build_users(params, _ctx(tok))


def test_agent_tool_results_answer_the_scripted_tool_call(tok):
    seen_tool_turns = 0
    for index in range(12):
        thread = prompts.agent_thread(0, index, turns=5, turn_tokens=60, reply_tokens=20, tokenizer=tok)
        for before, turn in zip(thread.turns, thread.turns[1:]):
            calls = before.scripted_reply.get("tool_calls")
            if calls:
                seen_tool_turns += 1
                assert turn.kind == "tool"
                assert turn.new_messages[0]["role"] == "tool"
                assert turn.new_messages[0]["tool_call_id"] == calls[0]["id"]
            else:
                assert turn.kind in ("code", "prose")
        assert not thread.turns[-1].scripted_reply.get("tool_calls")
    assert seen_tool_turns > 0
    kinds = {t.kind for i in range(12) for t in prompts.agent_thread(0, i, 5, 60, 20, tok).turns}
    assert kinds == {"code", "prose", "tool"}


def test_depth_points_put_the_requested_context_before_the_question(tok):
    points = workloads.build_depth(workloads.DepthParams(depths=(0, 200, 800), output_tokens=8), _ctx(tok))
    sizes = [p.jobs[0][0].expected_prompt_tokens for p in points]
    assert sizes[0] < 60
    overhead = sizes[1] - 200
    assert 0 < overhead < 60 and sizes[2] - 800 == overhead  # same question and template around each document


def test_copy_asks_for_the_whole_document_back(tok):
    [point] = workloads.build_copy(workloads.CopyParams(document_tokens=220), _ctx(tok))
    spec = point.jobs[0][0]
    assert spec.max_tokens == 220 and len(tok.encode(point.reference_text)) == 220
    assert point.reference_text in spec.body["messages"][0]["content"]


def test_a_request_longer_than_the_server_allows_is_refused_before_sending(tok):
    with pytest.raises(BenchError, match="exceed the server's max_model_len 256"):
        workloads.build_c1(
            workloads.C1Params(input_tokens=200, output_tokens=100, requests=1), _ctx(tok, max_model_len=256)
        )


def test_sizes_below_their_minimum_are_refused():
    with pytest.raises(BenchError, match="--output-tokens 0: must be >= 1"):
        params_from_args(WORKLOADS["c1"], {"output_tokens": 0})
    with pytest.raises(BenchError, match="--concurrency 0"):
        params_from_args(WORKLOADS["c8"], {"concurrency": (4, 0)})
    assert params_from_args(WORKLOADS["depth"], {"depths": (0,)}).depths == (0,)
