"""Patch 0070: the suffix match behind lookup drafting, read straight from the patch.

`v1/spec_decode/lookup.py` is a new file of the series and imports only NumPy, so these
tests run it without vLLM: the module text is the patch's final state of that file
(tests/support/lookup_rule.py). The proposer's hook runs in a patched view of vLLM.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.support.lookup_rule import load_lookup_rule
from tests.support.vllm_views import last_json_line, run_python


@pytest.fixture(scope="module")
def lookup() -> types.ModuleType:
    return load_lookup_rule()


def fill(lookup, *args, **kwargs) -> list[int]:
    """The verify block's tokens (fill_lookup_drafts also says which positions lookup decided)."""
    tokens, _ = lookup.fill_lookup_drafts(*args, **kwargs)
    return tokens.tolist()


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
    assert fill(lookup, history, drafts, num_drafter_tokens=3) == document[5:12].tolist()


def test_block_keeps_drafter_tokens_where_nothing_matches(lookup):
    history = np.arange(500, 540)
    drafts = ids(11, 12, 13, 14, 15)
    assert fill(lookup, history, drafts, 3) == drafts.tolist()


def test_lookup_positions_continue_the_drafters_path_not_the_history(lookup):
    # The drafter diverges from the copy (short match): lookup must follow the drafter's
    # path (here "20 21" recurs, followed by 22 23), never the history's continuation.
    history = ids(20, 21, 22, 23, 5, 6, 7, 8, 5, 6)
    drafts = ids(20, 21, 0, 0)
    assert fill(lookup, history, drafts, 2) == [20, 21, 22, 23]


def test_a_verbatim_copy_leads_the_whole_block_over_a_diverging_drafter(lookup):
    document = np.arange(2000, 2030)
    history = np.concatenate([document, document[:10]])  # a copy 10 tokens long
    drafts = ids(-1, -2, -3, -4, -5, -6)
    assert fill(lookup, history, drafts, num_drafter_tokens=3, max_match=8) == document[10:16].tolist()
    # A drafter that agrees with the copy keeps its positions; lookup continues it.
    drafts = np.concatenate([document[10:13], ids(-1, -1, -1)])
    assert fill(lookup, history, drafts, 3) == document[10:16].tolist()


def test_block_never_changes_length_or_touches_a_full_drafter_block(lookup):
    history = np.concatenate([np.arange(40), np.arange(4)])
    drafts = ids(-1, -1, -1)
    assert fill(lookup, history, drafts, 3) == [-1, -1, -1]  # match < max
    assert fill(lookup, history, ids(), 0) == []


def test_placeholder_tokens_in_the_history_are_never_proposed(lookup):
    # An asynchronous scheduler leaves -1 where a sampled token is not written back yet.
    # "1 2 3" recurs and was followed by a placeholder: the drafter's token stays there.
    history = ids(1, 2, 3, -1, 9, 1, 2)
    assert fill(lookup, history, ids(3, 70, 71, 72), 1) == [3, 70, 9, 1]
    # A verbatim copy of placeholders never leads the block.
    drafts = ids(40, 41, 42, 43)
    assert fill(lookup, np.array([-1] * 12), drafts, 1) == drafts.tolist()


def test_block_reports_every_position_lookup_decided_also_where_the_drafter_agreed(lookup):
    """A decided position is a point mass whatever the drafter proposed there: its token is a
    function of the history (and the drafter's earlier positions), not a sample of the drafter's."""
    # The continuation after "1 2 3 4" is "5 6"; the drafter had guessed the 5 already.
    tokens, decided = lookup.fill_lookup_drafts(ids(1, 2, 3, 4, 5, 6, 1, 2), ids(3, 4, 5, 0), 2)
    assert (tokens.tolist(), decided.tolist()) == ([3, 4, 5, 6], [False, False, True, True])
    # A verbatim copy decides position 0 even when the drafter agrees (then lookup continues
    # the drafter's path past its 3 positions); a disagreeing drafter hands lookup the block.
    document = np.arange(2000, 2030)
    history = np.concatenate([document, document[:10]])
    agreeing = np.concatenate([document[10:13], ids(-1, -1, -1)])
    tokens, decided = lookup.fill_lookup_drafts(history, agreeing, 3)
    assert tokens.tolist() == document[10:16].tolist()
    assert decided.tolist() == [True, False, False, True, True, True]
    tokens, decided = lookup.fill_lookup_drafts(history, agreeing, 6)  # no position past the drafter's
    assert (tokens.tolist(), decided.tolist()) == (agreeing.tolist(), [True] + [False] * 5)
    tokens, decided = lookup.fill_lookup_drafts(history, ids(-1, -2, -3, -4, -5, -6), 3)
    assert tokens.tolist() == document[10:16].tolist() and decided.all()


def test_block_reports_nothing_decided_where_the_drafter_tokens_stay(lookup):
    _, decided = lookup.fill_lookup_drafts(np.arange(500, 540), ids(11, 12, 13, 14, 15), 3)
    assert not decided.any()
    # A placeholder in the continuation leaves the drafter's token there, undecided.
    tokens, decided = lookup.fill_lookup_drafts(ids(1, 2, 3, -1, 9, 1, 2), ids(3, 70, 71, 72), 1)
    assert (tokens.tolist(), decided.tolist()) == ([3, 70, 9, 1], [False, False, True, True])
    _, decided = lookup.fill_lookup_drafts(np.array([-1] * 12), ids(40, 41, 42, 43), 1)
    assert not decided.any()
    tokens, decided = lookup.fill_lookup_drafts(ids(1, 2), ids(), 0)
    assert tokens.shape == decided.shape == (0,)


FILL_CHECK = r"""
import json, types
import numpy as np, torch
from vllm.v1.spec_decode.dflash import DFlashProposer

tokens = np.zeros((3, 16), dtype=np.int32)
tokens[0, :6] = [1, 2, 3, 4, 5, 6]
tokens[1, :6] = [1, 2, 3, 4, 5, 6]
tokens[2, :3] = [9, 8, 7]
batch = types.SimpleNamespace(num_tokens_no_spec=np.array([6, 6, 3]), token_ids_cpu=tokens)
# This step accepted "1 2" for requests 0 and 1 (the rest rejected: -1) and "6" for request 2.
# Lookup continues "1 2 3 4" with "5 6": request 0's drafter guessed the 5, request 1's both;
# nothing recurs in request 2's "9 8 7 6".
drafts = torch.tensor([[3, 4, 5, 0], [3, 4, 5, 6], [7, 7, 7, 7]], dtype=torch.int32)
sampled = torch.tensor([[1, 2, -1], [1, 2, -1], [6, -1, -1]])


def fill(rows):
    probs = torch.full((len(rows), 4, 10), 0.1)
    proposer = types.SimpleNamespace(num_drafter_tokens=2, _last_draft_probs=probs)
    rows_batch = types.SimpleNamespace(
        num_tokens_no_spec=batch.num_tokens_no_spec[rows], token_ids_cpu=batch.token_ids_cpu[rows]
    )
    out = DFlashProposer.fill_lookup_tokens(proposer, drafts[rows], sampled[rows], rows_batch)
    point_mass = [[bool(row.max() == 1 and row.sum() == 1) for row in request] for request in probs]
    at = [[int(row.argmax()) if mass else None for row, mass in zip(request, masses)]
          for request, masses in zip(probs, point_mass)]
    kept = [[bool(torch.all(row == 0.1)) for row in request] for request in probs]
    return out, {"drafts": out.tolist(), "dtype": str(out.dtype), "point_mass": point_mass, "at": at,
                 "kept": kept}


everything, result = fill([0, 1, 2])
agreeing, agreeing_result = fill([1])  # lookup decided positions but changed no token
nothing = drafts[[2]]
unmatched = DFlashProposer.fill_lookup_tokens(
    types.SimpleNamespace(num_drafter_tokens=2, _last_draft_probs=torch.full((1, 4, 10), 0.1)),
    nothing, sampled[[2]],
    types.SimpleNamespace(num_tokens_no_spec=np.array([3]), token_ids_cpu=tokens[[2]]),
)
print(json.dumps({
    "all": result, "agreeing": agreeing_result, "untouched_input": drafts.tolist(),
    "unmatched_returns_its_input": unmatched is nothing,
}))
"""


@pytest.fixture(scope="module")
def proposer_fill(vllm_views) -> dict:  # noqa: F811
    return last_json_line(run_python(FILL_CHECK, vllm_views["patched"]))


def test_proposer_fills_lookup_positions_past_the_drafters(proposer_fill):
    """The V1 DFlash proposer's hook: history = committed + this step's accepted tokens."""
    result = proposer_fill["all"]
    assert result["drafts"] == [[3, 4, 5, 6], [3, 4, 5, 6], [7, 7, 7, 7]]
    assert result["dtype"] == "torch.int32"
    assert proposer_fill["untouched_input"] == [[3, 4, 5, 0], [3, 4, 5, 6], [7, 7, 7, 7]]


def test_proposer_makes_every_position_lookup_decided_a_point_mass_also_where_the_drafter_agreed(
    proposer_fill,
):
    """A drafter probability q(x) < 1 left at a lookup position would accept x with
    min(1, p/q) > p and resample from the wrong residual: probabilistic verification would
    no longer be exact. Request 0's position 2 and all of request 1's lookup positions hold
    the drafter's own tokens; they must be point masses like the changed position."""
    result = proposer_fill["all"]
    assert result["point_mass"][:2] == [[False, False, True, True]] * 2
    assert result["at"][:2] == [[None, None, 5, 6]] * 2
    assert result["kept"][:2] == [[True, True, False, False]] * 2  # the drafter's positions
    assert result["kept"][2] == [True] * 4  # nothing matched: the drafter's probabilities stay
    # The same when no request's token changed at all (no early return before the point masses).
    agreeing = proposer_fill["agreeing"]
    assert agreeing["drafts"] == [[3, 4, 5, 6]]
    assert agreeing["point_mass"] == [[False, False, True, True]]
    assert agreeing["at"] == [[None, None, 5, 6]]


def test_proposer_returns_its_input_when_lookup_decided_nothing(proposer_fill):
    assert proposer_fill["unmatched_returns_its_input"]
