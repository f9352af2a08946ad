#!/usr/bin/env bash
# The GPU tier (`make gpu-test`): on a CUDA machine with vLLM 0.28.0 importable, apply
# patches/series to that vLLM, prove delivery, print the versions, then run tests/gpu.
# Without an NVIDIA GPU it says so and exits 0 (the CPU suite is `make test`).
#   PYTHON   interpreter that imports vllm and torch (default: python3)
#   QWEN38_GPU_REPORT     the tier report (JSON; default docs/gpu/<date>-<gpu>-tier.json)
#   QWEN38_GPU_CACHE_DIR  CACHE_DIR the profile servers share (default: a fresh temporary one);
#                         keep it between runs on one machine, or carry it in, for warm starts
# Arguments go to pytest instead of the default `tests/gpu` (e.g. one test file).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-test: skipped: no NVIDIA GPU visible to $PY (torch.cuda.is_available() is false); see docs/gpu.md"
  exit 0
fi
VLLM_DIR=$("$PY" -c 'import importlib.util as u; s = u.find_spec("vllm"); print(s.submodule_search_locations[0] if s else "")')
if [[ -z "$VLLM_DIR" ]]; then
  echo "gpu-test: vLLM 0.28.0 (CUDA build) is not importable by $PY; see docs/gpu.md" >&2
  exit 2
fi

"$PY" -m entrypoint.cli patches apply --vllm-dir "$VLLM_DIR"
"$PY" -m entrypoint.cli patches check --vllm-dir "$VLLM_DIR"
"$PY" - <<'EOF'
import importlib.metadata as md, platform, torch, triton
props = torch.cuda.get_device_properties(0)
print(f"gpu: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB; "
      f"driver CUDA {torch.version.cuda}; torch {torch.__version__}; triton {triton.__version__}; "
      f"vllm {md.version('vllm')}; flashinfer {md.version('flashinfer-python')}; python {platform.python_version()}")
EOF
"$PY" -m entrypoint.cli doctor --profile single || true  # a report (no 3090 here), not a gate
# The images build FlashInfer's sampling and top-k modules when they are built (`qwen38
# toolchain prebuild`); a bare CUDA machine builds those missing here, once, so a profile's
# first start is timed as it is in an image (without, the first engine JIT-builds them:
# minutes of nvcc).
if "$PY" -c 'import flashinfer' 2>/dev/null; then
  "$PY" -m entrypoint.cli toolchain prebuild || echo "gpu-test: the FlashInfer prebuild failed: the first engine start JIT-builds it"
fi
if [[ -z "${QWEN38_GPU_REPORT:-}" ]]; then
  gpu=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0).split()[1].lower())')
  QWEN38_GPU_REPORT="docs/gpu/$(date -u +%F)-$gpu-tier.json"
  export QWEN38_GPU_REPORT
fi
echo "gpu-test: tier report $QWEN38_GPU_REPORT"
(( $# )) || set -- tests/gpu
exec "$PY" -m pytest -m gpu -p no:cacheprovider -rA --durations=0 -s "$@"
