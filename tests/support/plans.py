"""Settings as a user without a .env would have them, and one planner run (two vLLM
processes: stock and patched tree) shared by the tests that check the capacity figures
and the page-layout patch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.support.session_cache import once_per_run
from tests.support.vllm_views import child_pythonpath

# The knobs that override a profile: None unless a test sets them, so nothing from the
# developer's shell leaks into a resolution.
OVERRIDES = (
    "max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "speculation", "mtp_depth", "lookup", "verify_block",
    "prefix_caching", "enable_thinking", "cuda_visible_devices", "custom_all_reduce", "nccl_p2p",
    "head_address", "node_address", "network_interface", "rdma_devices", "nccl_log_level",
)  # fmt: skip
# The parallel knobs with a default of their own, at that default.
PARALLEL_DEFAULTS = {"gpu_link": "auto", "node_rank": 0, "head_port": 29501}
# What a user of a multi-host profile has set on the head (docs/dual.md): the link's address
# and interface, as on a pair of DGX Sparks cabled port to port.
PAIR_HEAD = {"head_address": "192.168.100.10", "network_interface": "enp1s0f1np1"}
PAIR_WORKER = {**PAIR_HEAD, "node_rank": 1, "node_address": "192.168.100.11"}

# (profile, prefix caching override); None keeps the profile's own setting.
SEED_CASES = (
    ("single", False),
    ("single", True),
    ("long", False),
    ("long", True),
    ("huge", False),
    ("huge", True),
    ("batch", False),
    ("batch", True),
    ("spark-lora", None),
    ("dual", False),
    ("dual", True),
    ("spark-pair", None),
)


def user_settings(profile: str = "cpu", **values):
    """`Settings` for ``profile`` with exactly ``values`` overridden (no .env, no knob from
    the environment); ``models_dir`` defaults to a directory with no models in it, and a
    multi-host profile gets the head's link knobs (`PAIR_HEAD`) unless ``values`` names them."""
    from core.profiles import PROFILES_DIR, load_profile
    from core.settings import Settings

    directory = values.get("profiles_dir", PROFILES_DIR)
    pair = PAIR_HEAD if load_profile(profile, directory).parallel.nodes > 1 else {}
    values = {**dict.fromkeys(OVERRIDES), **PARALLEL_DEFAULTS, **pair, **values}
    values.setdefault("models_dir", Path("/nonexistent-models"))
    return Settings(_env_file=None, profile=profile, **values)


@pytest.fixture
def planner_pythonpath(monkeypatch):
    """The planner's vLLM child finds this checkout (and the torchvision stand-in)."""
    monkeypatch.setenv("PYTHONPATH", child_pythonpath())


@pytest.fixture(scope="session")
def seed_plans(tmp_path_factory):
    """{(profile, prefix_caching): Plan} for the provisional profiles, both trees: one planner
    run for the whole test run (tests/conftest.py holds the fixture, so every module shares it;
    xdist's workers share its result, `tests.support.session_cache.once_per_run`)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")

    def plan_seed_cases() -> dict:
        from core.profiles import load_profile
        from entrypoint.model_configs import read_model_configs
        from entrypoint.resolve import resolve

        models_dir = tmp_path_factory.mktemp("no-models")  # no served dirs: the config copies are used
        items = []
        for name, pc in SEED_CASES:
            profile = load_profile(name)
            resolved = resolve(profile, user_settings(name, models_dir=models_dir, prefix_caching=pc))
            items.append((resolved, read_model_configs(profile, resolved, models_dir)))
        plans = plan_in_children(items, compare=True)
        return {case: plan for case, plan in zip(SEED_CASES, plans, strict=True)}

    return once_per_run(tmp_path_factory, "seed-plans", plan_seed_cases)


def plan_in_children(items: list, *, compare: bool) -> list:
    """`plan_engines` with this checkout first on the planner children's PYTHONPATH."""
    from entrypoint.plan import plan_engines  # the planner imports vLLM's helpers: at use, like the fixtures'

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_pythonpath()
    try:
        return plan_engines(items, compare=compare)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def render_resolved(profile, settings, api_key, **kwargs):
    """`entrypoint.launch.render_invocation` of the command's one resolution of ``profile`` and
    ``settings`` (as `qwen38 render` and `qwen38 serve` resolve it, without this host's link)."""
    from entrypoint.launch import render_invocation
    from entrypoint.resolve import resolve

    return render_invocation(profile, settings, api_key, resolved=resolve(profile, settings), **kwargs)
