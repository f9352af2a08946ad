"""`qwen38 plan`: will this profile fit, before 20 GB of weights are loaded?

The planner asks vLLM 0.28.0's own KV-cache functions (see `entrypoint.kv_capacity`)
what the profile's KV pool holds: pool tokens, blocks, per-request state, maximum
concurrency at the profile's context length, and whether that context fits while
every slot is busy. It answers twice, against a stock and a patched view of the
installed vLLM tree (our series changes the page layout), each in a child process.

The engine that will serve decides which answer counts (``Plan.patched``): the
patched one for a profile that requires the patches (the launcher refuses to serve it
otherwise), else whatever the installed tree is. ``Plan.fits`` is vLLM's own
admission rule: one request of the profile's max_model_len fits in the pool; when it
is False the engine would refuse at start (`_check_enough_kv_cache_memory`).

Model shapes come from the served directory's config.json when it exists, else from
the config-only copy in ``profiles/model-configs/<artifact>/``; weight quantization
is dropped from the copy the planner reads (it does not change the KV cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from entrypoint.errors import PlanError, StackError
from entrypoint.profiles import PROFILES_DIR, ModelSlot, Profile, load_profile

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIGS_DIR = PROFILES_DIR / "model-configs"
PLAN_TIMEOUT_S = 600

Variant = Literal["patched", "stock"]


@dataclass(frozen=True)
class Machine:
    """What the planner needs to know about a GPU it is not running on."""

    capability: tuple[int, int]
    memory_gib: int


MACHINES = {
    "rtx3090": Machine((8, 6), 24),
    "dgx-spark": Machine((12, 1), 128),
}


class GroupRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["attention", "gdn-state", "sliding-window"]
    layers: int
    block_size: int
    page_bytes: int
    blocks_per_request: int


class Capacity(BaseModel):
    """vLLM's answer for one version of the tree (stock or patched)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fits: bool
    refusal: str | None = None
    layout_error: str | None = None
    pool_bytes: int | None = None
    pool_tokens: int | None = None
    max_concurrency: float | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    bytes_per_block: int | None = None
    group_size: int | None = None
    groups: list[GroupRow] = []
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    blocks_per_request_at_max_len: int | None = None
    blocks_per_request_minimum: int | None = None
    state_bytes_per_request: int | None = None
    window_bytes_per_request: int | None = None
    context_bytes_per_token: float | None = None
    slots_resident: int | None = None
    slots_resident_with_max_context: int | None = None
    fits_with_all_slots_busy: bool = False
    max_model_len_that_fits: int | None = None
    backend: str | None = None
    drafter_backend: str | None = None
    async_scheduling: bool | None = None
    max_num_batched_tokens: int | None = None
    mamba_cache_mode: str | None = None


class Plan(BaseModel):
    """The capacity of a profile on the engine that will serve it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str
    patched: bool
    fits: bool
    pool_tokens: int
    max_concurrency: float
    fits_with_all_slots_busy: bool
    max_model_len: int
    max_num_seqs: int
    pool_bytes: int
    serving: Capacity
    variants: dict[str, Capacity]
    model_configs: dict[str, str]

    def refusal_line(self) -> str:
        """One line for the launcher when the profile cannot fit."""
        cap = self.serving
        return (
            f"profile {self.profile}: a {self.max_model_len:,}-token request does not fit the "
            f"{self.pool_bytes:,}-byte KV pool ({'patched' if self.patched else 'stock'} vLLM): "
            f"the pool holds {self.pool_tokens:,} tokens at this layout, "
            f"max_model_len that fits is {cap.max_model_len_that_fits or 0:,}; "
            "lower MAX_MODEL_LEN or raise KV_CACHE_MEMORY_BYTES"
        )


# ---- inputs -------------------------------------------------------------------------


def _engine_values(profile: Profile, settings: Any | None) -> dict[str, Any]:
    engine = profile.engine
    values = {
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "kv_cache_memory_bytes": engine.kv_cache_memory_bytes,
        "enable_prefix_caching": engine.enable_prefix_caching,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "mamba_ssm_cache_dtype": engine.mamba_ssm_cache_dtype,
        "dtype": engine.dtype,
        "block_size": engine.block_size,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
    }
    if settings is not None:
        for field, key in (
            ("max_model_len", "max_model_len"),
            ("max_num_seqs", "max_num_seqs"),
            ("kv_cache_memory_bytes", "kv_cache_memory_bytes"),
            ("prefix_caching", "enable_prefix_caching"),
        ):
            value = getattr(settings, field, None)
            if value is not None:
                values[key] = value
    if values["kv_cache_memory_bytes"] is None:
        raise PlanError(
            f"profile {profile.name}: engine.kv_cache_memory_bytes is not set; the planner (and a "
            "reproducible start) needs the KV pool pinned in bytes (KV_CACHE_MEMORY_BYTES)"
        )
    if values["max_num_batched_tokens"] is None:
        values["max_num_batched_tokens"] = _default_batched_tokens(profile)
    return values


def _default_batched_tokens(profile: Profile) -> int:
    """vLLM 0.28.0's API-server default (engine/arg_utils.py get_batch_defaults):
    8192 from 70 GiB of device memory, 16384 from 160 GiB, else 2048."""
    if profile.platform != "cuda":
        return 2048
    memory = _machine(profile).memory_gib
    return 16384 if memory >= 160 else 8192 if memory >= 70 else 2048


def _machine(profile: Profile) -> Machine:
    machine = MACHINES.get(profile.machine)
    if machine is None and profile.cuda_arch is None:
        raise PlanError(
            f"profile {profile.name}: machine {profile.machine!r} is unknown to the planner "
            f"(known: {', '.join(MACHINES)}); set cuda_arch"
        )
    capability = machine.capability if machine else (0, 0)
    if profile.cuda_arch:
        major, _, minor = profile.cuda_arch.partition(".")
        capability = (int(major), int(minor or 0))
    return Machine(capability, machine.memory_gib if machine else 0)


def config_source(slot: ModelSlot, models_dir: Path) -> Path:
    """config.json of the served directory, else the artifact's config-only copy."""
    served = models_dir / slot.dir / "config.json"
    if served.is_file():
        return served
    if slot.artifact is not None:
        copy = MODEL_CONFIGS_DIR / slot.artifact / "config.json"
        if copy.is_file():
            return copy
    raise PlanError(
        f"no config.json for model dir {slot.dir!r}: neither {served} nor "
        f"{MODEL_CONFIGS_DIR / str(slot.artifact) / 'config.json'} exists; prepare the model first"
    )


def _shape_only_copy(source: Path, dest: Path) -> str:
    """config.json without weight quantization, in its own directory."""
    config = json.loads(source.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return str(dest)


def _is_dflash2(config_json: Path) -> bool:
    config = json.loads(config_json.read_text(encoding="utf-8"))
    return "DFlash2DraftModel" in (config.get("architectures") or [])


def build_request(profile: Profile, settings: Any | None, workdir: Path) -> tuple[dict, dict[str, str]]:
    models_dir = Path(getattr(settings, "models_dir", None) or "models")
    sources = {"target": str(config_source(profile.models.target, models_dir))}
    request: dict[str, Any] = {
        "platform": profile.platform,
        "device_capability": list(_machine(profile).capability) if profile.platform == "cuda" else None,
        "engine": _engine_values(profile, settings),
        "target_dir": _shape_only_copy(Path(sources["target"]), workdir / "target"),
        "speculative": None,
        "attention_backend": (profile.engine.extra or {}).get("attention_backend"),
    }
    speculation = getattr(settings, "speculation", None) if settings is not None else None
    spec = profile.speculative
    if spec is not None and speculation is not False:
        # Lookup drafting widens the verify block: every slot keeps state and KV for
        # drafter depth + lookup tokens. The KV arithmetic needs only the total width,
        # so stock and patched trees plan the same request.
        try:
            lookup_tokens = spec.lookup_tokens(
                getattr(settings, "lookup", None), getattr(settings, "verify_block", None)
            )
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        speculative: dict[str, Any] = {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens + lookup_tokens,
        }
        if spec.draft_sample_method:
            speculative["draft_sample_method"] = spec.draft_sample_method
        if spec.attention_backend:
            speculative["attention_backend"] = spec.attention_backend
        if spec.uses_drafter and profile.models.drafter is not None:
            sources["drafter"] = str(config_source(profile.models.drafter, models_dir))
            speculative["model"] = _shape_only_copy(Path(sources["drafter"]), workdir / "drafter")
            if lookup_tokens and _is_dflash2(Path(sources["drafter"])):
                raise PlanError(
                    f"LOOKUP=true: profile {profile.name}'s drafter ({profile.models.drafter.dir}) is a "
                    f"DFlash2DraftModel, which runs on vLLM's V2 model runner; patch 0070 implements lookup "
                    "drafting in the V1 runner's DFlash proposer only; set LOOKUP=false"
                )
        request["speculative"] = speculative
    return request, sources


# ---- running vLLM's arithmetic --------------------------------------------------------


def _run_variant(requests: list[dict], tree: Path, workdir: Path) -> list[Capacity]:
    env = dict(os.environ)
    path = [str(tree), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    # Never write bytecode into (or next to) the installed tree the view links to.
    env["PYTHONPYCACHEPREFIX"] = str(workdir / "pycache")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "entrypoint.kv_capacity"],
            input=json.dumps({"requests": requests}),
            capture_output=True,
            text=True,
            env=env,
            timeout=PLAN_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise PlanError(f"the planner's vLLM process did not answer within {PLAN_TIMEOUT_S} s") from None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        results = json.loads(lines[-1])["results"]
    except (IndexError, KeyError, json.JSONDecodeError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PlanError(f"the planner's vLLM process failed (exit {done.returncode}): {tail}") from None
    capacities = []
    for result in results:
        if "error" in result:
            raise PlanError(f"vLLM could not build the profile's engine config: {result['error']}")
        capacities.append(Capacity.model_validate(result))
    return capacities


def _serving_variant(profile: Profile, tree_is_patched: bool) -> Variant:
    if profile.require_patches:
        return "patched"
    return "patched" if tree_is_patched else "stock"


def plan_profiles(
    items: list[tuple[Profile, Any | None]],
    *,
    compare: bool = True,
    vllm_dir: Path | None = None,
    series_dir: Path | None = None,
) -> list[Plan]:
    """Plan several (profile, settings) pairs with one vLLM process per tree version."""
    from entrypoint.patches import SERIES_DIR, all_present, check_series, find_vllm_dir, series_tree

    series_dir = series_dir or SERIES_DIR
    vllm_dir = Path(vllm_dir) if vllm_dir else find_vllm_dir()
    tree_is_patched = all_present(check_series(vllm_dir, series_dir))
    servings = [_serving_variant(profile, tree_is_patched) for profile, _ in items]
    wanted = {v for v in servings} | ({"patched", "stock"} if compare else set())
    with tempfile.TemporaryDirectory(prefix="qwen38-plan-") as tmp:
        workdir = Path(tmp)
        built = [
            build_request(profile, settings, workdir / str(i)) for i, (profile, settings) in enumerate(items)
        ]
        trees = {}
        for variant in sorted(wanted):
            try:
                trees[variant] = series_tree(
                    vllm_dir, workdir / f"tree-{variant}", patched=variant == "patched", series_dir=series_dir
                )
            except StackError as exc:
                raise PlanError(f"cannot build a {variant} view of {vllm_dir}: {exc}") from None
        requests = [request for request, _ in built]
        with ThreadPoolExecutor(max_workers=len(trees)) as pool:
            futures = {v: pool.submit(_run_variant, requests, trees[v], workdir) for v in trees}
            answers = {v: f.result() for v, f in futures.items()}
    plans = []
    for index, ((profile, _), (request, sources), serving) in enumerate(
        zip(items, built, servings, strict=True)
    ):
        variants = {v: answers[v][index] for v in answers if compare or v == serving}
        chosen = variants[serving]
        engine = request["engine"]
        plans.append(
            Plan(
                profile=profile.name,
                patched=serving == "patched",
                fits=chosen.fits,
                pool_tokens=chosen.pool_tokens or 0,
                max_concurrency=chosen.max_concurrency or 0.0,
                fits_with_all_slots_busy=chosen.fits_with_all_slots_busy,
                max_model_len=engine["max_model_len"],
                max_num_seqs=engine["max_num_seqs"],
                pool_bytes=engine["kv_cache_memory_bytes"],
                serving=chosen,
                variants=variants,
                model_configs=sources,
            )
        )
    return plans


def plan_profile(
    profile: Profile,
    settings: Any | None = None,
    *,
    compare: bool = True,
    vllm_dir: Path | None = None,
    series_dir: Path | None = None,
) -> Plan:
    """Plan ``profile`` (with the user's overrides in ``settings``) on the engine that
    will serve it; with ``compare``, also on the other version of the tree."""
    return plan_profiles([(profile, settings)], compare=compare, vllm_dir=vllm_dir, series_dir=series_dir)[0]


def plan_cache_key(profile: Profile, settings: Any) -> str:
    """Everything a plan depends on: the profile, the overrides, the model configs it reads,
    the series and whether the installed tree carries it, and the vLLM version."""
    from entrypoint.patches import all_present, check_series, find_vllm_dir, series_fingerprint
    from entrypoint.verify import installed_vllm
    from prepare.identity import digest_of

    vllm_dir = find_vllm_dir()
    configs = {}
    for name, slot in profile.models:
        if slot is not None and name in ("target", "drafter"):
            source = config_source(slot, Path(settings.models_dir))
            configs[name] = source.read_text() if source is not None else None
    overrides = {
        k: getattr(settings, k, None)
        for k in (
            "max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "prefix_caching", "speculation", "lookup",
            "verify_block",
        )
    }
    return digest_of(
        {
            "profile": profile.model_dump(mode="json"),
            "overrides": overrides,
            "configs": configs,
            "series": series_fingerprint(),
            "tree_patched": all_present(check_series(vllm_dir)),
            "vllm": installed_vllm(),
        }
    )


def cached_plan(profile: Profile, settings: Any, cache_dir: Path) -> tuple[Plan, bool]:
    """The serving plan, reused while nothing it depends on changed (a restart costs no
    planning); returns (plan, was_cached)."""
    from prepare.atomic import atomic_write_text

    path = Path(cache_dir) / "plan" / f"{profile.name}-{plan_cache_key(profile, settings)[:16]}.json"
    if path.is_file():
        try:
            return Plan.model_validate_json(path.read_text()), True
        except ValueError:
            path.unlink(missing_ok=True)
    plan = plan_profile(profile, settings, compare=False)
    atomic_write_text(path, plan.model_dump_json(indent=2) + "\n")
    return plan, False


# ---- CLI --------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):,.1f} MiB"


def render_plan(plan: Plan) -> str:
    lines = [
        f"profile {plan.profile}: {plan.max_model_len:,}-token context, {plan.max_num_seqs} slots, "
        f"KV pool {plan.pool_bytes:,} B",
    ]
    order = ["patched", "stock"] if plan.patched else ["stock", "patched"]
    for name in [n for n in order if n in plan.variants]:
        cap = plan.variants[name]
        serving = " (serves)" if (name == "patched") == plan.patched else ""
        lines.append(f"  {name} vLLM 0.28.0{serving}:")
        if cap.layout_error:
            lines.append(f"    no page layout: {cap.layout_error}")
            continue
        lines += [
            f"    pool tokens        {cap.pool_tokens:,}  (max concurrency {cap.max_concurrency:.2f}x "
            f"at {cap.max_model_len:,} tokens)",
            f"    blocks             {cap.num_blocks:,} x {cap.block_size} tokens, {cap.group_size} layers "
            f"per group, {_mib(cap.bytes_per_block)} per block",
            f"    per request        {cap.blocks_per_request_at_max_len} blocks at max context, "
            f"{cap.blocks_per_request_minimum} at least; state {_mib(cap.state_bytes_per_request)}, "
            f"drafter window {_mib(cap.window_bytes_per_request)}, "
            f"{(cap.context_bytes_per_token or 0) / 1024:,.1f} KiB per context token",
            f"    slots resident     {cap.slots_resident} of {cap.max_num_seqs} (short requests), "
            f"{cap.slots_resident_with_max_context} with one at max context",
            f"    backend            {cap.backend}"
            + (f", drafter {cap.drafter_backend}" if cap.drafter_backend else ""),
            f"    max context fits   {'yes' if cap.fits else 'NO'}"
            + ("" if cap.fits else f" (fits up to {cap.max_model_len_that_fits:,} tokens)")
            + f"; with all slots busy: {'yes' if cap.fits_with_all_slots_busy else 'no'}",
        ]
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    from entrypoint.settings import load_settings

    settings = load_settings(profile=args.profile) if args.profile else load_settings()
    profile = load_profile(settings.profile)
    plan = plan_profile(profile, settings, compare=not args.no_compare)
    if args.json:
        print(plan.model_dump_json(indent=2))
    else:
        print(render_plan(plan))
    if not plan.fits:
        raise PlanError(plan.refusal_line())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="compute the KV pool, slots and max context of a profile with vLLM's own functions",
        description="Ask vLLM 0.28.0's KV-cache functions whether the profile's max context fits its "
        "KV pool, with and without our patches. Exits non-zero when it does not fit.",
    )
    parser.add_argument("--profile", help="profile name (default: PROFILE from the settings)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--no-compare", action="store_true", help="only plan the engine that will serve")
    parser.set_defaults(func=_cmd_plan)
