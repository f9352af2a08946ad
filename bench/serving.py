"""The serving benchmarks: build a workload's requests, run its points, make the result document.

`run_workload` builds the workload's prompts from the seed with the server's tokenizer,
sends unmeasured warm-up requests, runs each point and returns the result document
(`bench.report`), whose consistency checks compare streamed tokens with usage, usage with
/tokenize and /metrics, and the speculative counters. Run it against an otherwise idle
server: /metrics counters are server-wide. `qwen38 bench c1|c8|agent|users|depth|copy|image` is its
command line (`bench.commands.server`).
"""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import provenance, report
from bench.measurement import ServerTokenizer, run_point, warm_up
from bench.prompts import PROMPTS_VERSION
from bench.workloads import Context, Workload
from core.errors import BenchError
from entrypoint.client import StackClient

DEFAULT_SEED = 0


def _list_models(client: StackClient) -> list[dict[str, Any]]:
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise BenchError(f"{client.base_url}/v1/models answered {response.status_code} (wrong or missing API key?)")
    return response.json()["data"]


def run_workload(
    client: StackClient,
    workload: Workload,
    params: Any,
    *,
    model: str,
    seed: int = DEFAULT_SEED,
    warmup: int = 1,
    cache_salt: bool = True,
    identity_file: Path | None = None,
    cache_dir: Path | None = None,
    machine_note: str | None = None,
    progress=print,
) -> dict[str, Any]:
    """Build, warm up, measure every point; the result document (see `report`)."""
    models = _list_models(client)
    ids = [m["id"] for m in models]
    if model not in ids:
        raise BenchError(f"--model {model}: the server lists {ids}")
    server = provenance.server_identity(client, model, models, identity_file=identity_file, cache_dir=cache_dir)
    salt = secrets.token_hex(6) if cache_salt else None
    ctx = Context(
        model=model,
        seed=seed,
        tokenizer=ServerTokenizer(client, model),
        cache_salt=salt,
        max_model_len=server["max_model_len"],
    )
    started = time.perf_counter()
    points = workload.build(params, ctx)
    progress(
        f"bench {workload.name}: {sum(len(j) for p in points for j in p.jobs)} requests in {len(points)} "
        f"point(s), prompts built in {time.perf_counter() - started:.1f} s"
    )
    if warmup:
        own = workload.warm_up(params, ctx) if workload.warm_up is not None else []
        warm_up(client, [ctx.warm_up_request()] * warmup + own * warmup)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    runs = []
    for point in points:
        run = run_point(client, point.jobs, point.concurrency)
        completion = sum(r.completion_tokens or 0 for r in run.records)
        progress(f"  {point.label}: {len(run.records)} requests, {completion} tokens in {run.duration_s:.2f} s")
        runs.append(run)
    run_settings = {
        "model": model,
        "seed": seed,
        "prompts_version": PROMPTS_VERSION,
        "warmup": warmup,
        "cache_salt": salt,
        "temperature": 0,
        "ignore_eos": True,
        "thinking": False,
    }
    return report.build_document(
        workload,
        params,
        points,
        runs,
        run_settings=run_settings,
        server=server,
        machine=provenance.client_machine(machine_note),
        versions=provenance.versions(),
        started_at=started_at,
    )

