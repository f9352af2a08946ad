"""One planner run (two vLLM processes: stock and patched tree) shared by the tests
that check the capacity figures and the page-layout patch."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from tests.support.vllm_views import child_pythonpath

# (profile, prefix caching override); None keeps the profile's own setting.
SEED_CASES = (
    ("single", False),
    ("single", True),
    ("long", False),
    ("long", True),
    ("spark-lora", None),
)


@pytest.fixture(scope="session")
def seed_plans(tmp_path_factory):
    """{(profile, prefix_caching): Plan} for the provisional profiles, both trees."""
    from entrypoint.plan import plan_profiles
    from entrypoint.profiles import load_profile

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment")
    models_dir = tmp_path_factory.mktemp("no-models")  # no served dirs: the config copies are used
    items = [
        (load_profile(name), SimpleNamespace(models_dir=models_dir, prefix_caching=pc))
        for name, pc in SEED_CASES
    ]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_pythonpath()
    try:
        plans = plan_profiles(items, compare=True)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return {case: plan for case, plan in zip(SEED_CASES, plans, strict=True)}
