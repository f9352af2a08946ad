"""`qwen38 serve`: the start-up flow of docs/architecture.md, one step after the other.

settings -> resolve -> verify -> plan -> launch -> ready gate. Each step lives in its own
module; this one runs them in order, prints one line for what each proved, and stops at
the first that fails (its `StackError`, one line). The engine is resolved once
(`resolve_on_this_host`) and that one `ResolvedEngine` is handed down to every step: the
planner plans exactly what the launch runs, and no step resolves it again.

Cheap refusals come first: conflicting knobs (`resolve`), what only a launch refuses
(`entrypoint.launch.check_allocator`, `check_multi_host`) and values the models cannot take
(`check_plannable`) are refused before a file is hashed. The launch is a supervisor
(`entrypoint.supervise`): vLLM runs as its child, the readiness gate beside it, and SIGTERM
stops every engine process within the drain plus a fixed margin. The child is started before
verify and held until the plan passes, so that its import of vLLM (the largest part of a
start on a small machine) runs while the files are hashed and the plan is computed.
"""

from __future__ import annotations

import os
import time

from core.errors import PlanError
from core.profiles import Profile
from core.progress import say
from core.settings import Settings, load_serving
from entrypoint import ready
from entrypoint.launch import check_allocator, check_kv_cache_build, render_invocation, write_run_files
from entrypoint.model_configs import read_model_configs
from entrypoint.patches import installed_vllm
from entrypoint.plan import check_plannable, plan_engines
from entrypoint.resolve import resolve_on_this_host
from entrypoint.resolved_engine import ResolvedEngine
from entrypoint.supervise import Supervisor, begin_start, check_interpreter
from entrypoint.worker_gate import WorkerGate


def run_preflight(profile: Profile, settings: Settings, resolved: ResolvedEngine) -> str:
    """Verify, then plan; returns the identity string verify computed (for the status)."""
    # imported here, after the held engine's fork: it loads while the engine imports vLLM
    from entrypoint.verify import verify_profile

    try:  # values the models cannot take are refused before a file is hashed...
        configs = read_model_configs(profile, resolved, settings.models_dir)
        check_plannable(resolved, configs)
    except PlanError:
        configs = None  # ...but a model that is not there is verify's to explain

    report = verify_profile(profile, settings, reads_drafter=resolved.reads_drafter)
    say(f"qwen38: verified {profile.name} in {report.elapsed_s:.2f} s: {report.identity}")
    if configs is None:
        configs = read_model_configs(profile, resolved, settings.models_dir)
        check_plannable(resolved, configs)

    start = time.monotonic()
    (plan,) = plan_engines([(resolved, configs)], compare=False, cache_dir=settings.cache_dir)
    if not plan.fits:
        raise PlanError(plan.refusal_line())
    how = "plan reused" if plan.reused else f"planned in {time.monotonic() - start:.1f} s"
    busy = "" if plan.fits_with_all_slots_busy else "; not every slot can hold a max-length request at once"
    say(
        f"qwen38: {how}: KV pool {plan.pool_tokens:,} tokens ({'patched' if plan.patched else 'stock'} vLLM), "
        f"max concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens{busy}"
    )
    return report.identity


def serve_profile(profile_name: str | None = None, *, ready_gate: bool = True) -> int:
    """`qwen38 serve`: the start-up flow for ``profile_name`` (default: the PROFILE setting),
    then the supervisor's life; returns its exit code. Without ``ready_gate`` nothing proves
    the server ready."""

    began = time.monotonic()
    profile, settings, key = load_serving(profile_name)
    resolved = resolve_on_this_host(profile, settings)
    check_allocator(resolved, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    check_kv_cache_build(resolved, installed_vllm())
    worker = resolved.parallel is not None and resolved.parallel.headless
    # run lock, leftovers of a killed start, old verdict gone; a worker host listens on no API port
    start = begin_start(profile, settings, serves_api=not worker)
    invocation = render_invocation(profile, settings, key, resolved=resolved)
    check_interpreter(invocation)
    # The engine starts now, held: its vLLM import overlaps verify and plan; a refused
    # preflight ends it before it has read a weight.
    supervisor = Supervisor(invocation, start, gate=None)
    supervisor.prestart()
    try:
        identity = run_preflight(profile, settings, resolved)
        write_run_files(invocation)
        if worker:

            gate = WorkerGate(profile, settings, resolved, identity=identity)
            say(f"qwen38: serving profile {profile.name} as worker host {resolved.parallel.node_rank} of "
                f"{resolved.parallel.nodes} (no API here; head {gate.head})")
        else:
            gate = ready.Watcher(
                profile, settings, key, identity=identity, instance=start.instance, began=began, phase=supervisor.phase
            )
            say(f"qwen38: serving profile {profile.name} ({', '.join(profile.model_ids)}) on {gate.base_url}")
    except BaseException:
        supervisor.abandon()
        raise
    supervisor.gate = gate.run if ready_gate else None
    return supervisor.run()
