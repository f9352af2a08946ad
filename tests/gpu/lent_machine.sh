#!/usr/bin/env bash
# Stage the CUDA vLLM 0.28.0 payload on the lent GPU machine, where at most 64 MiB travels per
# call (docs/gpu.md). Build the payload here first:
#   ../shared/tools/gpu-payload.sh .device-payload      # part_00..part_05, 56 MiB each
#   pip download --python-version 3.12 --only-binary=:all: -d .whl pytest pytest-timeout tomli-w
# Then, one call per part (each carries .device-payload/part_NN):
#   tests/gpu/lent_machine.sh stage          copy this call's parts and wheels to /tmp
#   tests/gpu/lent_machine.sh tools          pytest & co. into /tmp/qwen38-tools (kernel tests)
#   tests/gpu/lent_machine.sh install        join the parts, unpack vLLM into /tmp/qwen38-site
#   source <(tests/gpu/lent_machine.sh env)  PYTHONPATH for both
set -euo pipefail
STAGE=/tmp/qwen38-payload
SITE=/tmp/qwen38-site
TOOLS=/tmp/qwen38-tools

case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    shopt -s nullglob
    for f in .device-payload/part_* .whl/*.whl; do cp "$f" "$STAGE/"; done
    echo "staged: $(cd "$STAGE" && echo *)"
    ;;
  tools)
    python3 -m pip install -q --no-index --no-deps --target "$TOOLS" "$STAGE"/*.whl
    ;;
  install)
    test -e "$SITE/vllm/__init__.py" && { echo "vLLM already unpacked in $SITE"; exit 0; }
    work=$(mktemp -d)
    cat "$STAGE"/part_* | tar -C "$work" -xf -
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
      "$work/payload/vllm-slim.zip" "$SITE"
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$work"/payload/deps/*.whl
    rm -rf "$work"
    echo "vLLM $(PYTHONPATH=$SITE python3 -c 'import importlib.metadata as m; print(m.version("vllm"))') in $SITE"
    ;;
  env)
    echo "export PYTHONPATH=$PWD:$SITE:$TOOLS"
    ;;
  *)
    echo "usage: $0 stage|tools|install|env" >&2
    exit 2
    ;;
esac
