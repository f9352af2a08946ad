"""`qwen38 plan`: will this profile fit, before 20 GB of weights are loaded?

The planner asks vLLM 0.28.0's own KV-cache functions (see `entrypoint.kv_capacity`)
what the KV pool of a resolved engine (`entrypoint.resolve`) holds: pool tokens, blocks,
per-request state, maximum concurrency at its context length, and whether that context
fits while every slot is busy. It can answer for a stock and a patched version of the
installed vLLM tree (our series changes the page layout), each in a child process: the
installed tree itself when it is that version, else a view of it (`series_tree`).

The engine that will serve decides which answer counts (``Plan.patched``): the
patched one for a profile that requires the patches (the launcher refuses to serve it
otherwise), else whatever the installed tree is. ``Plan.fits`` is vLLM's own
admission rule (one request of the engine's max_model_len fits in the pool; else the
engine would refuse at start, `_check_enough_kv_cache_memory`) and one more: such a
request must also fit while it runs, or it would stall the engine
(`entrypoint.kv_capacity._running_peak`, docs/plan.md).

`plan_methods` plans a profile once per speculation method it allows (dflash, mtp) and none,
and says how many of N concurrent requests each keeps resident (`qwen38 plan --concurrency N`,
docs/speculation.md).

Answers are kept in ``CACHE_DIR/plan/``, keyed by everything they depend on (the
resolved engine minus what cannot change the KV cache, the model configs, the patch
series and the tree's state, the vLLM version and the planner's own code), so a restart
or a second `qwen38 plan` costs no vLLM import; two planners of one engine at once (a head
and a worker host on one machine sharing CACHE_DIR) ask vLLM once, the second waiting for
the first's answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict

from core.atomic import atomic_write_text
from core.errors import PlanError, StackError
from core.identity import digest_of
from core.profiles import K4V2_KV_CACHE_DTYPE, Profile
from core.settings import Settings
from entrypoint.compile_cache import vllm_cache_root
from entrypoint.engine_args import planned_engine_args
from entrypoint.kv_capacity import K4V2_SOURCE, longest_request, request_blocks
from entrypoint.model_configs import ModelConfigs, check_model_limits, read_model_configs, shape_only_copy
from entrypoint.patches import SERIES_DIR, check_series, find_vllm_dir, installed_vllm, series_fingerprint, series_tree
from entrypoint.resolve import resolve
from entrypoint.resolved_engine import ResolvedEngine
from entrypoint.vision_memory import VisionMemory, pool_for_vision, vision_memory, vision_refusal

REPO_ROOT = Path(__file__).resolve().parent.parent
# The planner's own code: the child that asks vLLM, where its request's vLLM arguments come from, and
# the definition of the KV format it lays out itself where vLLM lacks it (k4v2_g128).
PLANNER_CODE = (Path(__file__).with_name("kv_capacity.py"), Path(__file__).with_name("engine_args.py"), K4V2_SOURCE)
PLAN_TIMEOUT_S = 600

Variant = Literal["patched", "stock"]

# Fields of the resolved engine the KV arithmetic cannot depend on; every other field is
# part of the plan cache key (a field added later re-plans until someone says why not).
PLAN_IGNORED = {
    "served_model_name": "the id clients use",
    "tool_call_parser": "API layer",
    "reasoning_parser": "API layer",
    "structured_outputs_config": "API layer",
    "default_chat_template_kwargs": "API layer",
    "seed": "sampling",
    "shutdown_timeout": "how long a stop waits, not what runs",
    "target_dir": "the config.json text is hashed instead of its path",
    "speculative.drafter_dir": "the config.json text is hashed instead of its path",
    "lora.adapter_id": "which adapter, not its shape",
    "lora.path": "which adapter, not its shape",
    "lora.base_model_name": "which adapter, not its shape",
    "overridden": "where a value came from, not the value",
    "devices": "which GPUs, not their shape",
    "parallel.node_rank": "every host holds the same share",
    "parallel.link": "how the GPUs talk, not what they keep",
    "parallel.link_origin": "where a value came from, not the value",
    "parallel.custom_all_reduce": "how the GPUs talk, not what they keep",
    "parallel.nccl_p2p": "how the GPUs talk, not what they keep",
    "parallel.head_address": "where the hosts are, not what they keep",
    "parallel.head_port": "where the hosts are, not what they keep",
    "parallel.node_address": "where the hosts are, not what they keep",
    "parallel.network_interface": "where the hosts are, not what they keep",
    "parallel.rdma_devices": "where the hosts are, not what they keep",
    "parallel.nccl_log_level": "NCCL's log level",
    "vision.processor_kwargs": "which image processor reads the pixels (PIL or torchvision), not what runs after",
}


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
    blocks_per_request_at_peak: int | None = None
    lookahead_tokens: int | None = None  # KV slots the drafter writes past a request's tokens (vLLM's)
    stall: str | None = None  # admitted by vLLM, but too big while it runs (kv_capacity._running_peak)
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
    kv_cache_dtype: str | None = None  # the target's attention layers' KV format
    kv_layout: str | None = None  # who laid its pages out: "vLLM's", or the planner from the format's definition

    def peak_terms(self) -> tuple[list[dict[str, Any]], int, int]:
        """What a running request's peak is priced from (`entrypoint.kv_capacity.request_blocks`):
        the groups, the drafter's lookahead slots, and the state block async scheduling keeps in
        flight per GDN group (1 or 0)."""
        return [row.model_dump() for row in self.groups], self.lookahead_tokens or 0, int(bool(self.async_scheduling))


class Plan(BaseModel):
    """The capacity of a resolved engine on the engine that will serve it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str
    patched: bool
    fits: bool
    pool_tokens: int
    max_concurrency: float
    fits_with_all_slots_busy: bool
    max_model_len: int
    max_num_seqs: int
    pool_bytes: int  # per GPU
    speculative_tokens: int
    prefix_caching: bool
    serving: Capacity
    variants: dict[str, Capacity]
    model_configs: dict[str, str]
    reused: bool = False  # read from the plan cache, not computed by this call
    tensor_parallel_size: int = 1  # GPUs each layer is split over; the pool is each one's
    vision: VisionMemory | None = None  # the tower and the encoder cache (VISION=true)
    vision_refusal: str | None = None  # why VISION=true does not fit the profile's pool, and what does

    def pool_text(self) -> str:
        each = " on each of its GPUs" if self.tensor_parallel_size > 1 else ""
        return f"{self.pool_bytes:,}-byte KV pool{each}"

    def refusal_line(self) -> str:
        """One line for the launcher when the profile cannot fit."""
        if self.vision_refusal is not None:
            return self.vision_refusal
        cap = self.serving
        return (
            f"profile {self.profile}: a {self.max_model_len:,}-token request does not fit the "
            f"{self.pool_text()} ({'patched' if self.patched else 'stock'} vLLM): "
            f"the pool holds {self.pool_tokens:,} tokens at this layout, "
            f"max_model_len that fits is {cap.max_model_len_that_fits or 0:,}; "
            "lower MAX_MODEL_LEN or raise KV_CACHE_MEMORY_BYTES"
            + (f" ({cap.stall})" if cap.stall else "")
        )


# ---- inputs (pure, but for the shape-only copies) ------------------------------------


def machine_of(resolved: ResolvedEngine) -> Machine:
    machine = MACHINES.get(resolved.machine)
    if machine is None and resolved.cuda_arch is None:
        raise PlanError(
            f"profile {resolved.profile}: machine {resolved.machine!r} is unknown to the planner "
            f"(known: {', '.join(MACHINES)}); set cuda_arch"
        )
    capability = machine.capability if machine else (0, 0)
    if resolved.cuda_arch:
        major, _, minor = resolved.cuda_arch.partition(".")
        capability = (int(major), int(minor or 0))
    return Machine(capability, machine.memory_gib if machine else 0)


def batched_tokens(resolved: ResolvedEngine) -> int:
    """The engine's max_num_batched_tokens: the profile's, else vLLM 0.28.0's API-server
    default (engine/arg_utils.py get_batch_defaults): 8192 from 70 GiB of device memory,
    16384 from 160 GiB, else 2048."""
    if resolved.max_num_batched_tokens is not None:
        return resolved.max_num_batched_tokens
    if resolved.platform != "cuda":
        return 2048
    memory = machine_of(resolved).memory_gib
    return 16384 if memory >= 160 else 8192 if memory >= 70 else 2048


def check_plannable(resolved: ResolvedEngine, configs: ModelConfigs) -> None:
    """The refusals that need no vLLM: an unpinned pool, values the models cannot take."""
    if resolved.kv_cache_memory_bytes is None:
        raise PlanError(
            f"profile {resolved.profile}: engine.kv_cache_memory_bytes is not set; the planner (and a "
            "reproducible start) needs the KV pool pinned in bytes (KV_CACHE_MEMORY_BYTES)"
        )
    if resolved.platform == "cuda":
        machine_of(resolved)
    check_model_limits(resolved, configs.target.data, target_source=str(configs.target.path))


def build_request(resolved: ResolvedEngine, configs: ModelConfigs, workdir: Path) -> dict:
    """The JSON request `entrypoint.kv_capacity` answers for one resolved engine: vLLM's own
    arguments for it (`entrypoint.engine_args.planned_engine_args`), and where it will run."""
    check_plannable(resolved, configs)
    cuda = resolved.platform == "cuda"
    drafter = shape_only_copy(configs.drafter, workdir / "drafter") if configs.drafter is not None else None
    return {
        "platform": resolved.platform,
        "device_capability": list(machine_of(resolved).capability) if cuda else None,
        "engine_args": planned_engine_args(
            resolved,
            target=shape_only_copy(configs.target, workdir / "target"),
            drafter=drafter,
            batched_tokens=batched_tokens(resolved),
        ),
        "attention_backend": resolved.attention_backend,
        "env": resolved.env,
    }


def stock_refusal(resolved: ResolvedEngine) -> Capacity | None:
    """Stock vLLM 0.28.0's answer where it cannot even parse the engine: a KV cache dtype only our
    series defines (k4v2_g128; `--kv-cache-dtype` refuses the name). None: ask vLLM."""
    if resolved.kv_cache_dtype != K4V2_KV_CACHE_DTYPE:
        return None
    line = f"stock vLLM 0.28.0 has no kv_cache_dtype {K4V2_KV_CACHE_DTYPE} (the series adds it: docs/kv-k4v2.md)"
    return Capacity(fits=False, refusal=line, layout_error=line, max_model_len=resolved.max_model_len,
                    max_num_seqs=resolved.max_num_seqs, kv_cache_dtype=resolved.kv_cache_dtype)


# ---- the installed tree ----------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """The installed vLLM as the planner sees it."""

    vllm_dir: Path
    series_dir: Path
    state: Literal["patched", "stock", "partial"]

    def serving(self, resolved: ResolvedEngine) -> Variant:
        """The version of the tree that will serve: patched where the profile requires it."""
        return "patched" if resolved.require_patches or self.state == "patched" else "stock"


def installed_tree(vllm_dir: Path | None = None, series_dir: Path | None = None) -> Tree:
    series_dir = series_dir or SERIES_DIR
    vllm_dir = Path(vllm_dir) if vllm_dir else find_vllm_dir()
    statuses = check_series(vllm_dir, series_dir)
    if all(s.state == "present" for s in statuses):
        state = "patched"
    elif all(s.state == "absent" for s in statuses):
        state = "stock"
    else:
        state = "partial"
    return Tree(vllm_dir, series_dir, state)


# ---- running vLLM's arithmetic --------------------------------------------------------


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    # A pydantic validation error: "1 validation error for X", then the field, then the message.
    if len(lines) > 1 and "validation error" in lines[0]:
        lines = [line for line in lines[1:] if not line.startswith("For further information")]
        return "; ".join(lines)[:600]
    return (lines[0] if lines else "no message")[:600]


def _run_variant(requests: list[dict], tree: Tree, variant: Variant, workdir: Path) -> list[Capacity]:
    """Answer ``requests`` in one child process whose ``vllm`` is ``variant`` of the tree."""
    env = dict(os.environ)
    path = [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.pop("PYTHONPYCACHEPREFIX", None)  # the installed tree's bytecode is what makes the import cheap
    if tree.state != variant:

        try:
            view = series_tree(tree.vllm_dir, workdir / f"tree-{variant}", patched=variant == "patched",
                               series_dir=tree.series_dir)
        except StackError as exc:
            raise PlanError(f"cannot build a {variant} view of {tree.vllm_dir}: {exc}") from None
        path.insert(0, str(view))
        # The view links to the installed files: read their bytecode, never write next to them.
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(path)
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
            raise PlanError(f"vLLM refuses the engine configuration: {_one_line(result['error'])}")
        capacities.append(Capacity.model_validate(result))
    return capacities


def plan_cache_key(resolved: ResolvedEngine, configs: ModelConfigs, tree: Tree) -> str:
    """Everything a plan depends on: the resolved engine (minus `PLAN_IGNORED`), the model
    configs it reads, the patch series and the state of the installed tree, the vLLM
    version and the planner's code."""

    return digest_of(
        {
            "engine": resolved.factors(PLAN_IGNORED),
            "configs": {name: config.text for name, config in (("target", configs.target),
                                                                ("drafter", configs.drafter)) if config},
            "series": series_fingerprint(tree.series_dir),
            "tree": [str(tree.vllm_dir), tree.state],
            "vllm": installed_vllm(),
            "planner": [hashlib.sha256(p.read_bytes()).hexdigest() for p in PLANNER_CODE],
        }
    )


def _cache_path(cache_dir: Path, resolved: ResolvedEngine, key: str, variant: Variant) -> Path:
    return Path(cache_dir) / "plan" / f"{resolved.profile}-{key[:16]}-{variant}.json"


def _lock_path(cache_dir: Path, resolved: ResolvedEngine, key: str) -> Path:
    return Path(cache_dir) / "plan" / f".{resolved.profile}-{key[:16]}.lock"


@contextlib.contextmanager
def _one_planner_per_key(lock_paths: list[Path]) -> Iterator[None]:
    """Holds these plans' locks (in one order: no two planners wait on each other). A planner
    that finds one held waits for the answer being computed and reads it from the cache, so two
    starts of one engine sharing a CACHE_DIR (a head and a worker host on one machine, a restart
    racing a `qwen38 plan`) ask vLLM once."""
    with contextlib.ExitStack() as stack:
        for path in sorted(set(lock_paths)):
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = stack.enter_context(open(path, "a+b"))
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # released when the handle closes, or the process dies
        yield


def _read_cached(path: Path) -> Capacity | None:
    try:
        return Capacity.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def _compute(
    items: list[tuple[ResolvedEngine, ModelConfigs]],
    missing: dict[Variant, list[int]],
    servings: list[Variant],
    tree: Tree,
    cache_dir: Path | None,
) -> dict[tuple[int, Variant], Capacity]:
    """vLLM's answers for the ``missing`` (variant -> item indices), one child per variant."""
    with tempfile.TemporaryDirectory(prefix="qwen38-plan-") as tmp:
        workdir = Path(tmp)
        indices = sorted({i for wanted in missing.values() for i in wanted})
        requests = {i: build_request(*items[i], workdir / str(i)) for i in indices}

        def for_variant(index: int, variant: Variant) -> dict:
            # The serving tree's answer runs with the engine's own VLLM_CACHE_ROOT: the model
            # info vLLM records there while planning is what the engine would otherwise spend
            # a second vLLM import on at its first start (vLLM checks it by source hash).
            root = workdir / f"vllm-cache-{variant}"
            if cache_dir is not None and variant == servings[index] and tree.state == variant:
                root = vllm_cache_root(Path(cache_dir), items[index][0])
            request = requests[index]
            return {**request, "env": {**request["env"], "VLLM_CACHE_ROOT": str(root)}}

        with ThreadPoolExecutor(max_workers=len(missing)) as pool:
            futures = {
                v: pool.submit(_run_variant, [for_variant(i, v) for i in wanted], tree, v, workdir)
                for v, wanted in missing.items()
            }
            return {
                (index, variant): capacity
                for variant, future in futures.items()
                for index, capacity in zip(missing[variant], future.result(), strict=True)
            }


def plan_engines(
    items: list[tuple[ResolvedEngine, ModelConfigs]],
    *,
    compare: bool = True,
    cache_dir: Path | None = None,
    tree: Tree | None = None,
) -> list[Plan]:
    """Plan several resolved engines with at most one vLLM process per version of the
    tree, and none for answers already in ``cache_dir`` (new answers are kept there)."""

    tree = tree or installed_tree()
    servings = [tree.serving(resolved) for resolved, _ in items]
    wanted = [sorted({s} | ({"patched", "stock"} if compare else set())) for s in servings]
    paths: dict[tuple[int, Variant], Path] = {}
    locks: list[Path] = []
    if cache_dir is not None:
        for index, (resolved, configs) in enumerate(items):
            key = plan_cache_key(resolved, configs, tree)
            paths.update({(index, v): _cache_path(cache_dir, resolved, key, v) for v in wanted[index]})
            locks.append(_lock_path(cache_dir, resolved, key))
    with _one_planner_per_key(locks):
        answers = {slot: found for slot, path in paths.items() if (found := _read_cached(path)) is not None}
        for index, (resolved, _) in enumerate(items):
            if "stock" in wanted[index] and (refused := stock_refusal(resolved)) is not None:
                answers[index, "stock"] = refused
        reused = {i for i in range(len(items)) if all((i, v) in answers for v in wanted[i])}
        missing: dict[Variant, list[int]] = {}
        for index, variants in enumerate(wanted):
            for variant in variants:
                if (index, variant) not in answers:
                    missing.setdefault(variant, []).append(index)
        if missing:
            computed = _compute(items, missing, servings, tree, cache_dir)
            answers.update(computed)
            for slot, capacity in computed.items():
                if slot in paths:
                    atomic_write_text(paths[slot], capacity.model_dump_json(indent=2) + "\n")
    return [
        _assemble(resolved, configs, serving, {v: answers[index, v] for v in wanted[index]}, index in reused)
        for index, ((resolved, configs), serving) in enumerate(zip(items, servings, strict=True))
    ]


def _assemble(
    resolved: ResolvedEngine, configs: ModelConfigs, serving: Variant, variants: dict[str, Capacity], reused: bool
) -> Plan:
    chosen = variants[serving]
    vision, vision_refused = _vision(resolved, configs, chosen)
    return Plan(
        profile=resolved.profile,
        patched=serving == "patched",
        fits=chosen.fits and vision_refused is None,
        pool_tokens=chosen.pool_tokens or 0,
        max_concurrency=chosen.max_concurrency or 0.0,
        fits_with_all_slots_busy=chosen.fits_with_all_slots_busy,
        max_model_len=resolved.max_model_len,
        max_num_seqs=resolved.max_num_seqs,
        pool_bytes=resolved.kv_cache_memory_bytes or 0,
        tensor_parallel_size=resolved.parallel.tensor_parallel_size if resolved.parallel else 1,
        speculative_tokens=resolved.speculative.num_speculative_tokens if resolved.speculative else 0,
        prefix_caching=resolved.enable_prefix_caching,
        serving=chosen,
        variants=variants,
        model_configs=configs.sources(),
        reused=reused,
        vision=vision,
        vision_refusal=vision_refused,
    )


def _vision(
    resolved: ResolvedEngine, configs: ModelConfigs, chosen: Capacity
) -> tuple[VisionMemory | None, str | None]:
    """The tower and encoder cache VISION=true adds (`entrypoint.vision_memory`), and the refusal
    when they do not fit the profile's pool, with the longest request the smaller pool holds."""
    memory = vision_memory(resolved, configs.target.data, configs.target.path, batched_tokens(resolved))
    longest = None
    if memory is not None and chosen.bytes_per_block:
        blocks = pool_for_vision(resolved.kv_cache_memory_bytes or 0, memory) // chosen.bytes_per_block
        rows, lookahead, in_flight = chosen.peak_terms()
        longest = longest_request(rows, blocks, lookahead, in_flight, 1)
    return memory, vision_refusal(resolved, memory, longest)


def plan_profile(
    profile: Profile,
    settings: Settings,
    *,
    compare: bool = True,
    cache_dir: Path | None = None,
    tree: Tree | None = None,
) -> Plan:
    """Resolve ``profile`` with ``settings`` and plan it (see `plan_engines`)."""
    resolved = resolve(profile, settings)
    configs = read_model_configs(profile, resolved, settings.models_dir)
    check_plannable(resolved, configs)
    return plan_engines([(resolved, configs)], compare=compare, cache_dir=cache_dir, tree=tree)[0]


# ---- which speculation method keeps N requests resident ---------------------------------

Method = Literal["dflash", "mtp", "off"]


class Residency(BaseModel):
    """How many requests one speculation method keeps resident in the pool (`plan_methods`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str  # dflash, mtp or off
    speculative_tokens: int  # drafted per step (0: off)
    refusal: str | None = None  # the settings cannot serve this method (one line); nothing below then
    fits: bool = False  # the engine's own plan: a max_model_len request fits while it runs
    pool_tokens: int = 0
    max_concurrency: float = 0.0  # vLLM's: requests of max_model_len the pool holds at once
    max_model_len: int = 0
    slots: int = 0  # max_num_seqs: never more requests run at once
    state_bytes_per_request: int = 0  # recurrent (GDN) state, incl. the speculative blocks
    concurrency: int = 0  # the requests asked about
    longest_resident: int = 0  # tokens each of `concurrency` requests may reach, all resident
    request_tokens: int | None = None  # the length asked about, if any
    resident: int | None = None  # how many of `concurrency` requests of request_tokens stay resident

    @property
    def all_resident(self) -> bool:
        """Every one of the requests asked about runs at once, none preempted."""
        if self.refusal is not None or self.concurrency > self.slots:
            return False
        if self.request_tokens is None:
            return self.longest_resident > 0
        return self.resident == self.concurrency


def residency(method: str, plan: Plan, concurrency: int, request_tokens: int | None = None) -> Residency:
    """``concurrency`` requests (of ``request_tokens`` each, prompt and answer, no shared prefix)
    against the pool ``plan`` serves: each running request holds its recurrent state, the
    speculative state blocks, a drafter's window and its context's attention blocks at its peak
    (`entrypoint.kv_capacity.request_blocks`, the rule that keeps a request from preempting
    itself)."""
    cap = plan.serving
    rows, lookahead, in_flight = cap.peak_terms()
    num_blocks = cap.num_blocks or 0
    longest = min(plan.max_model_len, longest_request(rows, num_blocks, lookahead, in_flight, concurrency))
    resident = None
    if request_tokens is not None:
        each = request_blocks(rows, request_tokens, lookahead, in_flight)
        fitting = (num_blocks - 1) // each if each else concurrency
        resident = min(concurrency, plan.max_num_seqs, fitting) if request_tokens <= plan.max_model_len else 0
    return Residency(
        method=method,
        speculative_tokens=plan.speculative_tokens,
        fits=plan.fits,
        pool_tokens=plan.pool_tokens,
        max_concurrency=plan.max_concurrency,
        max_model_len=plan.max_model_len,
        slots=plan.max_num_seqs,
        state_bytes_per_request=cap.state_bytes_per_request or 0,
        concurrency=concurrency,
        longest_resident=longest,
        request_tokens=request_tokens,
        resident=resident,
    )


def method_settings(settings: Settings, method: Method) -> Settings:
    """``settings`` with SPECULATION=``method``; the knobs of the other methods (MTP_DEPTH;
    LOOKUP, VERIFY_BLOCK) dropped where they would not apply."""
    update: dict = {"speculation": False if method == "off" else method}
    if method != "mtp":
        update["mtp_depth"] = None
    if method != "dflash":
        update.update(lookup=None, verify_block=None)
    return settings.model_copy(update=update)


def plan_methods(
    profile: Profile,
    settings: Settings,
    concurrency: int,
    request_tokens: int | None = None,
    *,
    cache_dir: Path | None = None,
    tree: Tree | None = None,
) -> list[Residency]:
    """`residency` for every speculation method ``profile`` allows, then none: one vLLM
    process for all of them (the serving version of the tree), plans reused from ``cache_dir``.
    A method the settings cannot serve (e.g. speculation with prefix caching on the CPU build)
    is a refusal line in its row, not an error."""
    if concurrency < 1:
        raise PlanError(f"--concurrency {concurrency}: expected 1 or more requests")
    methods: list[Method] = [m for m in ("dflash", "mtp") if profile.speculative and m in profile.speculative.methods]
    items, rows = [], {}
    for method in [*methods, "off"]:
        try:
            resolved = resolve(profile, method_settings(settings, method))
            configs = read_model_configs(profile, resolved, settings.models_dir)
            check_plannable(resolved, configs)
        except StackError as exc:
            rows[method] = Residency(method=method, speculative_tokens=0, refusal=str(exc), concurrency=concurrency,
                                     request_tokens=request_tokens)
            continue
        items.append((method, resolved, configs))
    plans = plan_engines([(r, c) for _, r, c in items], compare=False, cache_dir=cache_dir, tree=tree)
    for (method, _, _), plan in zip(items, plans, strict=True):
        rows[method] = residency(method, plan, concurrency, request_tokens)
    return [rows[m] for m in [*methods, "off"]]
