"""Patch 0070: the suffix match behind lookup drafting, read straight from the patch.

`v1/spec_decode/lookup.py` is a new file of the series and imports only NumPy, so these
tests run it without vLLM: the module text is the patch's final state of that file.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from entrypoint.patches import content_at, load_series, state_hashes
from tests.support.vllm_views import last_json_line, run_python, vllm_views  # noqa: F401

LOOKUP_PATH = "v1/spec_decode/lookup.py"


@pytest.fixture(scope="module")
def lookup() -> types.ModuleType:
    series = load_series()
    text = content_at(series, LOOKUP_PATH, None, len(state_hashes(series, LOOKUP_PATH)) - 1)
    assert text is not None
    module = types.ModuleType("qwen38_lookup_under_test")
    exec(compile(text, LOOKUP_PATH, "exec"), module.__dict__)
    return module


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_longest_suffix_match_finds_the_longest_and_most_recent_occurrence(lookup):
    # Suffix "3 4 5": "4 5" occurs twice, "3 4 5" only once (followed by 9).
    history = ids(3, 4, 5, 9, 7, 4, 5, 8, 3, 4, 5)
    length, follow = lookup.longest_suffix_match(history, len(history))
    assert length == 3
    assert follow.tolist() == [9, 7, 4, 5, 8, 3, 4, 5]
    # Equally long matches: the later one wins.
    history = ids(1, 2, 10, 1, 2, 20, 1, 2)
    length, follow = lookup.longest_suffix_match(history, len(history))
    assert (length, follow.tolist()) == (2, [20, 1, 2])


def test_no_match_below_the_minimum_length_gives_nothing(lookup):
    history = ids(5, 1, 6, 7, 1)  # only the single token "1" recurs
    assert lookup.longest_suffix_match(history, len(history), min_match=2)[0] == 0
    assert lookup.longest_suffix_match(history, len(history), min_match=1)[0] == 1
    assert lookup.longest_suffix_match(ids(1), 1)[0] == 0
    assert lookup.longest_suffix_match(ids(), 0)[0] == 0


def test_match_length_stops_at_max_match_and_respects_num_tokens(lookup):
    chain = np.arange(100, 130)
    history = np.concatenate([chain, chain[:20], ids(0, 0, 0)])
    length, follow = lookup.longest_suffix_match(history, len(history) - 3, max_match=8)
    assert length == 8
    assert follow[:5].tolist() == [120, 121, 122, 123, 124]


def test_window_limits_the_search_to_recent_tokens(lookup):
    history = np.concatenate([ids(1, 2, 3, 4), np.arange(50, 90), ids(1, 2, 3)])
    assert lookup.longest_suffix_match(history, len(history))[0] == 3
    assert lookup.longest_suffix_match(history, len(history), window=20)[0] == 0


def test_continuation_of_a_periodic_suffix_repeats_the_period(lookup):
    history = ids(7, 1, 2, 1, 2, 1, 2)
    length, tokens = lookup.lookup_continuation(history, len(history), 5)
    assert length == 4
    assert tokens.tolist() == [1, 2, 1, 2, 1]


def test_block_keeps_the_drafter_tokens_and_continues_them_by_lookup(lookup):
    document = np.arange(1000, 1040)
    history = np.concatenate([ids(1, 2), document, ids(3), document[:5]])
    # The drafter got the next 3 right; lookup continues after them.
    drafts = np.concatenate([document[5:8], ids(-5, -5, -5, -5)])
    block = lookup.fill_lookup_drafts(history, drafts, num_drafter_tokens=3)
    assert block.tolist() == document[5:12].tolist()


def test_block_keeps_drafter_tokens_where_nothing_matches(lookup):
    history = np.arange(500, 540)
    drafts = ids(11, 12, 13, 14, 15)
    assert lookup.fill_lookup_drafts(history, drafts, 3).tolist() == drafts.tolist()


def test_lookup_positions_continue_the_drafters_path_not_the_history(lookup):
    # The drafter diverges from the copy (short match): lookup must follow the drafter's
    # path (here "20 21" recurs, followed by 22 23), never the history's continuation.
    history = ids(20, 21, 22, 23, 5, 6, 7, 8, 5, 6)
    drafts = ids(20, 21, 0, 0)
    assert lookup.fill_lookup_drafts(history, drafts, 2).tolist() == [20, 21, 22, 23]


def test_a_verbatim_copy_leads_the_whole_block_over_a_diverging_drafter(lookup):
    document = np.arange(2000, 2030)
    history = np.concatenate([document, document[:10]])  # a copy 10 tokens long
    drafts = ids(-1, -2, -3, -4, -5, -6)
    block = lookup.fill_lookup_drafts(history, drafts, num_drafter_tokens=3, max_match=8)
    assert block.tolist() == document[10:16].tolist()
    # A drafter that agrees with the copy keeps its positions; lookup continues it.
    drafts = np.concatenate([document[10:13], ids(-1, -1, -1)])
    assert lookup.fill_lookup_drafts(history, drafts, 3).tolist() == document[10:16].tolist()


def test_block_never_changes_length_or_touches_a_full_drafter_block(lookup):
    history = np.concatenate([np.arange(40), np.arange(4)])
    drafts = ids(-1, -1, -1)
    assert lookup.fill_lookup_drafts(history, drafts, 3).tolist() == [-1, -1, -1]  # match < max
    assert lookup.fill_lookup_drafts(history, ids(), 0).tolist() == []


def test_placeholder_tokens_in_the_history_are_never_proposed(lookup):
    # An asynchronous scheduler leaves -1 where a sampled token is not written back yet.
    # "1 2 3" recurs and was followed by a placeholder: the drafter's token stays there.
    history = ids(1, 2, 3, -1, 9, 1, 2)
    assert lookup.fill_lookup_drafts(history, ids(3, 70, 71, 72), 1).tolist() == [3, 70, 9, 1]
    # A verbatim copy of placeholders never leads the block.
    drafts = ids(40, 41, 42, 43)
    assert lookup.fill_lookup_drafts(np.array([-1] * 12), drafts, 1).tolist() == drafts.tolist()


FILL_CHECK = r"""
import json, types
import numpy as np, torch
from vllm.v1.spec_decode.dflash import DFlashProposer

probs = torch.full((2, 4, 10), 0.1)
proposer = types.SimpleNamespace(num_drafter_tokens=2, _last_draft_probs=probs)
tokens = np.zeros((2, 16), dtype=np.int32)
tokens[0, :6] = [1, 2, 3, 4, 5, 6]
tokens[1, :3] = [9, 8, 7]
batch = types.SimpleNamespace(num_tokens_no_spec=np.array([6, 3]), token_ids_cpu=tokens)
drafts = torch.tensor([[3, 4, 0, 0], [7, 7, 7, 7]], dtype=torch.int32)
# This step accepted "1 2" for request 0 (the rest rejected: -1) and "6" for request 1.
sampled = torch.tensor([[1, 2, -1], [6, -1, -1]])
out = DFlashProposer.fill_lookup_tokens(proposer, drafts, sampled, batch)
print(json.dumps({
    "drafts": out.tolist(), "dtype": str(out.dtype), "untouched_input": drafts.tolist(),
    "one_hot": [probs[0, 2].tolist(), probs[0, 3].tolist()],
    "kept": bool(torch.all(probs[0, :2] == 0.1)) and bool(torch.all(probs[1] == 0.1)),
}))
"""


def test_proposer_fills_lookup_positions_and_makes_their_draft_probs_point_masses(vllm_views):
    """The V1 DFlash proposer's hook: history = committed + this step's accepted tokens."""
    result = last_json_line(run_python(FILL_CHECK, vllm_views["patched"]))
    # Request 0: "1 2 3 4" (history + drafter) recurs, so lookup continues with 5 6.
    assert result["drafts"] == [[3, 4, 5, 6], [7, 7, 7, 7]]
    assert result["dtype"] == "torch.int32"
    assert result["untouched_input"] == [[3, 4, 0, 0], [7, 7, 7, 7]]
    assert result["one_hot"] == [[0, 0, 0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
    assert result["kept"]  # the drafter's positions and unchanged requests keep their probabilities
