"""`qwen38 bench plan`: what `qwen38 plan` costs, cold, cached and after a knob change.

For each profile, with a fresh ``CACHE_DIR``, runs ``qwen38 plan --profile P --no-compare``
(what `qwen38 serve` plans: the engine that will serve) as a user would, and times the
whole command from spawn to exit:

- ``cold``: nothing cached (a first start, or a new image);
- ``cached``: the same command again (a restart: the answer is read from ``CACHE_DIR/plan``);
- ``replan``: with ``MAX_MODEL_LEN`` halved (a knob changed: planned afresh);
- ``compare`` (with ``--compare``): the default ``qwen38 plan``, stock and patched tree, cold.

The load average is recorded before every run: on a 2-core machine a busy neighbour
doubles these figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.errors import BenchError
from core.profiles import load_profile
from core.settings import load_settings

REPO = Path(__file__).resolve().parents[1]


def _plan_once(profile: str, env: dict[str, str], *, compare: bool, timeout: float) -> dict[str, Any]:
    load = [round(x, 2) for x in os.getloadavg()]
    argv = [sys.executable, "-m", "entrypoint.cli", "plan", "--profile", profile, "--json"]
    if not compare:
        argv.append("--no-compare")
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or "{" not in done.stdout:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"`qwen38 plan --profile {profile}` failed (exit {done.returncode}): {tail}")
    plan = json.loads(done.stdout[done.stdout.index("{") :])
    return {
        "seconds": round(seconds, 2),
        "reused": plan["reused"],
        "pool_tokens": plan["pool_tokens"],
        "max_model_len": plan["max_model_len"],
        "loadavg_before": load,
    }


def measure_profile(profile: str, env: dict[str, str], workdir: Path, *, compare: bool, timeout: float) -> dict:
    """The cold, cached and re-planned `qwen38 plan` of one profile (and the cold comparison)."""

    settings = load_settings(profile=profile)
    max_len = load_profile(profile, settings.profiles_dir).engine.max_model_len
    cache = workdir / f"cache-{profile}"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**env, "CACHE_DIR": str(cache)}
    runs = {"cold": _plan_once(profile, env, compare=False, timeout=timeout)}
    runs["cached"] = _plan_once(profile, env, compare=False, timeout=timeout)
    changed = {**env, "MAX_MODEL_LEN": str(max(256, max_len // 2))}
    runs["replan"] = _plan_once(profile, changed, compare=False, timeout=timeout)
    if compare:
        fresh = workdir / f"cache-{profile}-compare"
        shutil.rmtree(fresh, ignore_errors=True)
        runs["compare"] = _plan_once(profile, {**env, "CACHE_DIR": str(fresh)}, compare=True, timeout=timeout)
    if runs["cold"]["reused"] or not runs["cached"]["reused"] or runs["replan"]["reused"]:
        raise BenchError(f"profile {profile}: the plan cache did not behave (cold/cached/replan reused: "
                         f"{runs['cold']['reused']}/{runs['cached']['reused']}/{runs['replan']['reused']})")
    return runs

