"""`qwen38 bench fullscale`: Qwen3.8-27B's own shapes on the lent GPU, step by step.

The lent machine lives 30 minutes and a call 10, so the work is cut into steps that each
write their JSON under ``ROOT/results`` as soon as they know something, and that a later
call resumes (docs/performance.md, "Running it"). ``run`` does whatever is next within one
call's budget and is simply issued again until it says ``done``:

    qwen38 bench fullscale run --root R --budget 540 --out $OUT   # again and again, then it reports

or the steps one by one:

    qwen38 bench fullscale rates      --root R           # per-core draw rates here -> projected generate time
    qwen38 bench fullscale patches    --root R           # the series applied to the importable vLLM, proven
    qwen38 bench fullscale bandwidth  --root R           # device copy bandwidth; does nvidia-smi list our pids
    qwen38 bench fullscale prebuild   --root R           # FlashInfer's sampling kernels, as the images build them
    qwen38 bench fullscale generate   --root R           # full-size artifacts (qwen38 generate --size full)
    qwen38 bench fullscale requantize --root R           # int8 embed/lm_head: RSS vs largest tensor, MB/s vs disk
    qwen38 bench fullscale adapter    --root R           # the spark-lora adapter from the NVFP4 target
    qwen38 bench fullscale profiles   --root R           # PROFILES_DIR: the real profiles, slots -> generated
    qwen38 bench fullscale start  PROFILE --root R       # qwen38 serve in its own session (setsid) + sampler
    qwen38 bench fullscale wait   PROFILE --root R       # until the readiness gate's verdict (or a timeout)
    qwen38 bench fullscale measure PROFILE --root R      # c1, c8, prefill 1k/10k/64k, footprint from the log
    qwen38 bench fullscale stop   PROFILE --root R
    qwen38 bench fullscale report --root R --out docs/gpu/DATE-GPU-fullscale.json

The steps are `bench.fullscale_steps`, what comes next `bench.fullscale_run`,
the pure arithmetic `bench.fullscale_figures` and `bench.roofline`, the command line
`bench.commands.lab`; here, which served copies a call names (``--served``).
"""

from __future__ import annotations

from bench.fullscale_steps import SERVED, Served
from core.errors import BenchError


def served_subset(names: str | None) -> dict[str, Served] | None:
    """``--served a,b``: those served copies, in `SERVED`'s order (None: all of them)."""
    if not names:
        return None
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SERVED]
    if unknown:
        raise BenchError(f"--served {','.join(unknown)}: unknown; expected some of {', '.join(SERVED)}")
    return {name: s for name, s in SERVED.items() if name in wanted}
