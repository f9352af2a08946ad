"""`qwen38 plan --concurrency N`: for each speculation method a profile allows, vLLM's own pool
and how long N requests may grow while all stay resident (issue 55: past a few users DFlash2's
speculative state per request eats the pool, MTP's less, none least)."""

from __future__ import annotations

import json

import pytest

from core.profiles import load_profile
from entrypoint.cli.plan import render_methods
from entrypoint.plan import Residency, method_settings, plan_methods, plan_profile
from tests.conftest import clean_env, run_cli
from tests.support.plans import planner_pythonpath, user_settings  # noqa: F401
from tests.support.vllm_views import child_pythonpath

MIB = 1 << 20


def test_each_method_drops_the_knobs_of_the_others(tmp_path):
    chosen = user_settings("single", models_dir=tmp_path, speculation="mtp", mtp_depth=3)
    assert (method_settings(chosen, "mtp").speculation, method_settings(chosen, "mtp").mtp_depth) == ("mtp", 3)
    assert method_settings(chosen, "dflash").mtp_depth is None
    assert method_settings(chosen, "off").speculation is False
    looking = user_settings("single", models_dir=tmp_path, lookup=True, verify_block=12)
    assert method_settings(looking, "dflash").lookup is True and method_settings(looking, "mtp").lookup is None


def _row(method, tokens, longest, resident, **kw):
    return Residency(method=method, speculative_tokens=tokens, fits=True, pool_tokens=70_000, max_concurrency=1.1,
                     max_model_len=65_536, slots=8, state_bytes_per_request=100 * MIB, concurrency=8,
                     longest_resident=longest, request_tokens=8_192, resident=resident, **kw)


def test_the_text_names_each_method_and_the_ones_that_keep_all_resident():
    text = render_methods("single", [_row("dflash", 7, 0, 3), _row("mtp", 4, 860, 4), _row("off", 0, 9_000, 8)])
    assert text.splitlines()[0] == "profile single: 8 concurrent requests of 8,192 tokens, by speculation method"
    assert "dflash K=7" in text and "8 at once do not fit at any length" in text and "3 of 8 resident" in text
    assert "(1.10 requests of 65,536)" in text
    assert "8 fit the pool up to 9,000 tokens each; 8 of 8 resident" in text
    assert text.splitlines()[-1] == "  all 8 resident with: off"
    refused = Residency(method="mtp", speculative_tokens=0, refusal="profile cpu: no", concurrency=8)
    text = render_methods("cpu", [refused, _row("off", 0, 100, 4)])
    assert "mtp        refused: profile cpu: no" in text
    assert text.splitlines()[-1].startswith("  no method keeps all 8 resident")


def test_more_requests_than_slots_are_never_all_resident():
    row = _row("off", 0, 9_000, 8).model_copy(update={"concurrency": 12})
    assert not row.all_resident
    assert "set MAX_NUM_SEQS=12" in render_methods("single", [row])


@pytest.mark.slow
def test_single_keeps_more_requests_resident_with_mtp_than_dflash_and_most_without(tmp_path, planner_pythonpath):
    """vLLM's arithmetic on `single`'s pinned 5.2 GiB pool (prefix caching on): DFlash2 K=7 keeps
    2 + 7 state blocks per GDN group and its drafter's window, MTP K=4 2 + 4 and one attention
    layer more (the head's), none 2; so 8 requests of 8,192 tokens: 3, 4 and 7 resident."""
    profile = load_profile("single")
    settings = user_settings("single", models_dir=tmp_path / "no-models")
    dflash, mtp, off = plan_methods(profile, settings, 8, 8_192, cache_dir=tmp_path / "cache")
    assert [r.method for r in (dflash, mtp, off)] == ["dflash", "mtp", "off"]
    assert (dflash.speculative_tokens, mtp.speculative_tokens, off.speculative_tokens) == (7, 4, 0)
    assert dflash.pool_tokens == profile.capacity.pool_tokens_prefix_caching == 68_605
    assert dflash.pool_tokens < mtp.pool_tokens < off.pool_tokens
    assert dflash.state_bytes_per_request > mtp.state_bytes_per_request > off.state_bytes_per_request
    assert (dflash.resident, mtp.resident, off.resident) == (3, 4, 7)
    assert dflash.longest_resident == 0 < mtp.longest_resident < off.longest_resident
    assert all(r.fits for r in (dflash, mtp, off)) and not any(r.all_resident for r in (dflash, mtp, off))
    # The plan of SPECULATION=mtp itself (read back from the cache: no second vLLM process)
    # counts the head's attention layer and its speculative state blocks.
    chosen = user_settings("single", models_dir=tmp_path / "no-models", speculation="mtp")
    plan = plan_profile(profile, chosen, compare=False, cache_dir=tmp_path / "cache")
    assert plan.reused and plan.speculative_tokens == 4 and plan.pool_tokens == mtp.pool_tokens
    groups = plan.serving.groups
    assert sum(g.layers for g in groups if g.kind == "attention") == 16 + 1  # the target's 16 and the head's
    assert plan.serving.lookahead_tokens == 4  # vLLM's: MTP drafts K past the scheduled tokens
    state = [g for g in groups if g.kind == "gdn-state"]
    assert all(g.blocks_per_request == 2 + 4 for g in state)  # align mode: 2 + speculative blocks


@pytest.mark.slow
def test_cli_prints_every_method_of_the_cpu_profile_as_json(tiny_root, tmp_path):
    """The `cpu` profile allows dflash and mtp (with PREFIX_CACHING=false, as the CPU build
    needs for speculation); with prefix caching on, both are refusal lines and none is planned."""
    env = clean_env(MODELS_DIR=str(tiny_root), CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=child_pythonpath())
    done = run_cli("plan", "--profile", "cpu", "--concurrency", "4", "--request-tokens", "4096", "--json",
                   env={**env, "PREFIX_CACHING": "false"})
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["method"], r["speculative_tokens"], r["refusal"]) for r in rows] == [
        ("dflash", 4, None), ("mtp", 4, None), ("off", 0, None)
    ]
    assert all(r["all_resident"] and r["resident"] == 4 for r in rows)  # the tiny model's 256 MiB pool
    done = run_cli("plan", "--profile", "cpu", "--concurrency", "4", env=env)
    assert done.returncode == 0, done.stderr
    assert "dflash K=4 refused: qwen38" not in done.stdout
    assert "refused: profile cpu: the CPU build cannot combine speculative decoding with prefix caching" in done.stdout
    assert done.stdout.splitlines()[-1] == "  all 4 resident with: off"
