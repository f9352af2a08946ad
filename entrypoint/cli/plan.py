"""`qwen38 plan`: the KV pool, slots and max context of a profile (`entrypoint.plan`)."""

from __future__ import annotations

import argparse
import json

from core.errors import PlanError
from core.settings import load_settings, load_settings_profile
from entrypoint import plan as planner


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):,.1f} MiB"


def _why_slots(cap: planner.Capacity) -> list[str]:
    """Why this many slots stay resident beside a max-context request: the blocks it holds while it
    runs, what another slot needs at least, what is left (none where it does not fit, or one slot)."""
    if not cap.fits or cap.max_num_seqs < 2:
        return []
    return [
        f"    why                one {cap.max_model_len:,}-token request takes {cap.blocks_per_request_at_max_len} of "
        f"the {cap.num_blocks} blocks ({cap.blocks_per_request_at_peak} at its running peak); another slot needs "
        f"{cap.blocks_per_request_minimum} even when short (its GDN state, a block per attention and window group): "
        f"{cap.num_blocks - cap.blocks_per_request_at_max_len} are left "
        f"({cap.num_blocks - cap.blocks_per_request_at_peak} at that peak)"
    ]


def render_plan(plan: planner.Plan) -> str:
    spec = f"speculation {plan.speculative_tokens} tokens" if plan.speculative_tokens else "no speculation"
    lines = [
        f"profile {plan.profile}: {plan.max_model_len:,}-token context, {plan.max_num_seqs} slots, "
        f"KV pool {plan.pool_bytes:,} B"
        + (f" per GPU x {plan.tensor_parallel_size} GPUs" if plan.tensor_parallel_size > 1 else "")
        + f", prefix caching {'on' if plan.prefix_caching else 'off'}, {spec}"
        + (" (plan reused)" if plan.reused else ""),
    ]
    if plan.vision is not None:
        v = plan.vision
        lines.append(
            f"  vision             tower {v.tower_bytes:,} B ({v.tower_source}), "
            + ("on the device; " if v.tower_place == "gpu" else
               f"in host memory (at most {v.device_tower_bytes:,} B of it on the device at once); ")
            + f"encoder cache {v.encoder_cache_bytes:,} B ({v.encoder_cache_tokens:,} tokens; "
            f"an image is at most {v.image_tokens:,})"
        )
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
            f"    per request        {cap.blocks_per_request_at_max_len} blocks at max context "
            f"({cap.blocks_per_request_at_peak} while it runs), {cap.blocks_per_request_minimum} at least; "
            f"state {_mib(cap.state_bytes_per_request)}, "
            f"drafter window {_mib(cap.window_bytes_per_request)}, "
            f"{(cap.context_bytes_per_token or 0) / 1024:,.1f} KiB per context token",
            f"    slots resident     {cap.slots_resident} of {cap.max_num_seqs} (short requests), "
            f"{cap.slots_resident_with_max_context} with one at max context",
            *_why_slots(cap),
            f"    backend            {cap.backend}"
            + (f", drafter {cap.drafter_backend}" if cap.drafter_backend else ""),
            *([f"    kv cache           {cap.kv_layout}"] if cap.kv_layout and cap.kv_layout != "vLLM's" else []),
            f"    max context fits   {'yes' if cap.fits else 'NO'}"
            + ("" if cap.fits else f" (fits up to {cap.max_model_len_that_fits:,} tokens)")
            + f"; with all slots busy: {'yes' if cap.fits_with_all_slots_busy else 'no'}",
        ]
    return "\n".join(lines)


def render_methods(profile: str, rows: list[planner.Residency]) -> str:
    """Which speculation method keeps the requests asked about resident, one line each."""
    first = rows[0]
    tokens = next((row.request_tokens for row in rows if row.request_tokens is not None), None)
    asked = f" of {tokens:,} tokens" if tokens is not None else ""
    lines = [f"profile {profile}: {first.concurrency} concurrent requests{asked}, by speculation method"]
    for row in rows:
        name = row.method if row.method == "off" or row.refusal else f"{row.method} K={row.speculative_tokens}"
        if row.refusal is not None:
            lines.append(f"  {name:<10} refused: {row.refusal}")
            continue
        lines.append(
            f"  {name:<10} pool {row.pool_tokens:,} tokens ({row.max_concurrency:.2f} requests of "
            f"{row.max_model_len:,}); state {_mib(row.state_bytes_per_request)} per request; "
            + (
                f"{row.concurrency} fit the pool up to {row.longest_resident:,} tokens each"
                if row.longest_resident
                else f"{row.concurrency} at once do not fit at any length (their state alone overflows the pool)"
            )
            + (f"; {row.resident} of {row.concurrency} resident" if row.resident is not None else "")
            + ("" if row.fits else " (its max context does not fit: `qwen38 plan` says why)")
        )
    slots = {row.slots for row in rows if row.refusal is None}
    if slots and first.concurrency > min(slots):
        lines.append(f"  only {min(slots)} slots: set MAX_NUM_SEQS={first.concurrency} to run them all at once")
    keep = [row.method for row in rows if row.all_resident]
    lines.append(
        f"  all {first.concurrency} resident with: {', '.join(keep)}"
        if keep
        else f"  no method keeps all {first.concurrency} resident: shorten them or raise KV_CACHE_MEMORY_BYTES"
    )
    return "\n".join(lines)


def _cmd_methods(args: argparse.Namespace, settings, profile) -> int:
    rows = planner.plan_methods(
        profile,
        settings,
        args.concurrency,
        args.request_tokens,
        cache_dir=None if args.no_cache else settings.cache_dir,
    )
    if args.json:
        print(json.dumps([{**row.model_dump(), "all_resident": row.all_resident} for row in rows], indent=2))
    else:
        print(render_methods(profile.name, rows))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    settings = load_settings(profile=args.profile)
    profile = load_settings_profile(settings)
    if args.request_tokens is not None and args.concurrency is None:
        raise PlanError("--request-tokens needs --concurrency N (how many such requests at once)")
    if args.concurrency is not None:
        return _cmd_methods(args, settings, profile)
    plan = planner.plan_profile(
        profile, settings, compare=not args.no_compare, cache_dir=None if args.no_cache else settings.cache_dir
    )
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
        "KV pool, with and without our patches. Exits non-zero when it does not fit. Answers are "
        "reused from CACHE_DIR/plan while nothing they depend on changed.",
    )
    parser.add_argument("--profile", help="profile name (default: PROFILE from the settings)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--no-compare", action="store_true", help="only plan the engine that will serve")
    parser.add_argument("--no-cache", action="store_true", help="compute afresh; do not read or write CACHE_DIR/plan")
    parser.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="instead: for each speculation method the profile allows (dflash, mtp) and none, the pool and "
        "how long N requests may grow while all stay resident (docs/speculation.md)",
    )
    parser.add_argument(
        "--request-tokens",
        type=int,
        metavar="L",
        help="with --concurrency: also say how many of N requests of L tokens (prompt + answer) stay resident",
    )
    parser.set_defaults(func=_cmd_plan)
