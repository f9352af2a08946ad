"""Preflight: what `qwen38 serve` proves before it loads a single weight.

The steps of DESIGN.md between settings and launch: verify (every served file against its
manifest and the lock, the engine version, patch delivery) and plan (the profile fits its
memory budget). Each step raises its own `StackError` with one actionable line; the
identity string verify computes goes into the readiness status.
"""

from __future__ import annotations

from entrypoint.launch import Invocation
from entrypoint.profiles import Profile
from entrypoint.settings import Settings


def run_preflight(profile: Profile, settings: Settings, invocation: Invocation) -> str:
    import time

    from entrypoint.errors import PlanError
    from entrypoint.plan import cached_plan
    from entrypoint.verify import verify_profile

    report = verify_profile(profile, settings)
    print(f"qwen38: verified {profile.name} in {report.elapsed_s:.2f} s: {report.identity}", flush=True)

    start = time.monotonic()
    plan, reused = cached_plan(profile, settings, settings.cache_dir)
    if not plan.fits:
        raise PlanError(plan.refusal_line())
    how = "plan reused" if reused else f"planned in {time.monotonic() - start:.1f} s"
    busy = "" if plan.fits_with_all_slots_busy else "; not every slot can hold a max-length request at once"
    print(
        f"qwen38: {how}: KV pool {plan.pool_tokens:,} tokens ({'patched' if plan.patched else 'stock'} vLLM), "
        f"max concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens{busy}",
        flush=True,
    )
    return report.identity
