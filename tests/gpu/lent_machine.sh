#!/usr/bin/env bash
# Stage the CUDA vLLM 0.28.0 payload on the lent GPU machine, where at most 64 MiB travels per
# call (docs/gpu.md). Build the payload here first:
#   ../shared/tools/gpu-payload.sh /tmp/payload       # part_00..part_05, 56 MiB each
#   tests/gpu/pack_site.sh /tmp/payload .device-payload  # site_00..site_03: one xz'd site, 4 calls
#   pip download --python-version 3.12 --only-binary=:all: -d .whl pytest pytest-timeout tomli-w py-spy
# and, optionally, FlashInfer's prebuilt modules brought back from a lease (the same FlashInfer
# and arch only): .device-payload/flashinfer-aot-sm90.tar.xz, carried in a call after the last
# site part (with .whl: the last part, it and the checkout together pass the 64 MiB a call carries).
# (the parts of gpu-payload.sh staged as they are work too: `install` takes either form)
# Then, one call per part (each carries .device-payload/part_NN; the first also the wheels, each
# named in carry: pytest, pluggy, iniconfig, packaging, pygments, pytest_timeout and tomli_w, which
# the GPU tests import; with the 8.4 MB checkout all of .whl, py_spy's 2.9 MB included, passes 64 MiB;
# a call names at most 8 paths: move py_spy's wheel out of .whl and carry `.whl` as one):
#   tests/gpu/lent_machine.sh stage          copy this call's parts and wheels to /tmp
#   tests/gpu/lent_machine.sh tools          pytest & co. into /tmp/qwen38-tools (kernel tests)
#   tests/gpu/lent_machine.sh install        join the parts, unpack vLLM into /tmp/qwen38-site
#   source <(tests/gpu/lent_machine.sh env)  PYTHONPATH for both
#   tests/gpu/lent_machine.sh fullscale-prep SERVED   `bench fullscale`'s preparation, overlapped
#   tests/gpu/lent_machine.sh fullscale-start ARGS    `bench fullscale run ARGS` detached (setsid)
#   tests/gpu/lent_machine.sh fullscale-wait SECONDS  until it ends, then its report into $OUT
# A tier run outlives the 10-minute call limit by running in a session of its own (setsid):
#   tests/gpu/lent_machine.sh tier-start [FILES]   start `make gpu-test` in the background
#   tests/gpu/lent_machine.sh tier-wait SECONDS    wait for every lane (at most SECONDS), then
#                                                  copy each lane's report and log, the serve
#                                                  logs and a sampler's record of what ran when
#                                                  into $OUT
# Lanes: QWEN38_TIER_LANE=NAME runs a second tier beside the first (its own report and log in
# /tmp/qwen38-tier-NAME), on the same GPU (16 cores, 139 GiB: the tiny engines use a fraction);
# QWEN38_TIER_AFTER=REGEX holds it back until the first lane's log matches (at most 20 min), so
# the first lane's cold start is timed alone; QWEN38_TIER_CACHE=DIR gives it another lane's
# CACHE_DIR (e.g. /tmp/qwen38-tier/cache: the JIT and compile caches the first lane filled).
set -euo pipefail
STAGE=/tmp/qwen38-payload
SITE=/tmp/qwen38-site
TOOLS=/tmp/qwen38-tools
TIER_ROOT=/tmp/qwen38-tier
TIER=$TIER_ROOT${QWEN38_TIER_LANE:+-$QWEN38_TIER_LANE}

all_lanes_done() {
  local lane
  for lane in "$TIER_ROOT" "$TIER_ROOT"-*; do
    if [ -d "$lane/repo" ] && [ ! -e "$lane/exit" ]; then return 1; fi
  done
  return 0
}

case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    shopt -s nullglob
    for f in .device-payload/part_* .device-payload/site_* .device-payload/flashinfer-aot-*.tar.xz .whl/*.whl; do cp "$f" "$STAGE/"; done
    echo "staged: $(cd "$STAGE" && echo *)"
    ;;
  tools)
    python3 -m pip install -q --no-index --no-deps --target "$TOOLS" "$STAGE"/*.whl
    ;;
  install)
    test -e "$SITE/vllm/__init__.py" && { echo "vLLM already unpacked in $SITE"; exit 0; }
    if compgen -G "$STAGE/site_*" > /dev/null; then
      mkdir -p "$SITE"
      cat "$STAGE"/site_* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" "$SITE"
    else
      work=$(mktemp -d)
      cat "$STAGE"/part_* | tar -C "$work" -xf -
      python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$work/payload/vllm-slim.zip" "$SITE"
      python3 -m pip install -q --no-index --no-deps --target "$SITE" "$work"/payload/deps/*.whl
      rm -rf "$work"
    fi
    # FlashInfer's sampling and top-k modules as a previous lease built them (`qwen38 toolchain
    # prebuild` for sm_90, into the site's AOT directory): `bench fullscale prebuild` then finds
    # them and saves its 3 minutes of nvcc. Either form of the payload takes them.
    for aot in "$STAGE"/flashinfer-aot-*.tar.xz; do
      if [ -e "$aot" ]; then tar -C "$SITE" -xJf "$aot"; echo "FlashInfer modules from $(basename "$aot")"; fi
    done
    echo "vLLM $(PYTHONPATH=$SITE python3 -c 'import importlib.metadata as m; print(m.version("vllm"))') in $SITE"
    ;;
  env)
    echo "export PYTHONPATH=$PWD:$SITE:$TOOLS"
    ;;
  fullscale-prep)
    # `bench fullscale run` prepares one step after another; here the steps that do not need
    # each other overlap (FlashInfer's prebuild is minutes of nvcc on the CPU, the generator
    # minutes of disk), and a sampler records where each engine is every 15 s (py-spy, into
    # the logs `run` brings back). Then: `bench fullscale run --root /tmp/qwen38-fullscale ...`.
    served=${2:?"usage: $0 fullscale-prep SERVED (a comma list, as for bench fullscale run --served)"}
    root=/tmp/qwen38-fullscale; q="python3 -m entrypoint.cli bench fullscale"
    mkdir -p "$root/logs"
    $q patches --root "$root" | tail -3
    $q bandwidth --root "$root" | tail -3
    CUDA_VISIBLE_DEVICES='' FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0} \
      $q prebuild --root "$root" > "$root/logs/prebuild.log" 2>&1 &
    builder=$!
    $q generate --root "$root" --served "$served" | tail -3
    # A `spark-lora` copy needs the adapter too (CPU and disk as requantize, other files).
    $q requantize --root "$root" | tail -3 &
    requantizer=$!
    # A failed step is reported and left to `run`, which tries it again and stops saying why.
    if [[ ",$served," == *,spark-lora* ]]; then $q adapter --root "$root" | tail -3 || echo "adapter failed"; fi
    wait "$requantizer" || echo "requantize failed"
    wait "$builder" || echo "prebuild failed: $root/logs/prebuild.log"
    tail -3 "$root/logs/prebuild.log"
    if [ -x "$TOOLS/bin/py-spy" ] && ! pgrep -f "lent_machine.sh fullscale-stacks" > /dev/null; then
      setsid nohup "$0" fullscale-stacks >> "$root/logs/stacks.log" 2>&1 < /dev/null &
    fi
    ;;
  fullscale-start)
    # `bench fullscale run` in a session of its own, for work longer than a call (a 245k-token
    # request, several copies): its arguments as for `run`, less --root and --out (the report goes
    # to $root/out when its budget ends or nothing is left). Then `fullscale-wait SECONDS`.
    shift
    root=/tmp/qwen38-fullscale; mkdir -p "$root/logs" "$root/out"
    if [ -e "$root/run.pid" ] && kill -0 "$(cat "$root/run.pid")" 2>/dev/null; then
      echo "a detached run is still going (pid $(cat "$root/run.pid")): $0 fullscale-wait SECONDS first" >&2; exit 1
    fi
    setsid nohup env PYTHONPATH="$PWD:$SITE:$TOOLS" PYTHONUNBUFFERED=1 python3 -m entrypoint.cli bench fullscale run \
      --root "$root" --out "$root/out" "$@" < /dev/null >> "$root/logs/run-detached.log" 2>&1 &
    echo $! > "$root/run.pid"
    echo "bench fullscale run detached (pid $!): $root/logs/run-detached.log"
    ;;
  fullscale-wait)
    # Until the detached run ends (at most SECONDS), then its report into $OUT; one still going
    # gets a report of what it has so far (`bench fullscale report` reads the same results).
    root=/tmp/qwen38-fullscale; out=${OUT:-$root/collected}; mkdir -p "$out"
    deadline=$(( $(date +%s) + ${2:?seconds} ))
    pid=$(cat "$root/run.pid" 2>/dev/null || echo 0)
    while [ "$pid" != 0 ] && kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    if [ "$pid" != 0 ] && kill -0 "$pid" 2>/dev/null; then
      echo "still running (pid $pid); the report so far:"
      python3 -m entrypoint.cli bench fullscale report --root "$root" --out "$out/fullscale-so-far.json" | tail -5 || true
      tail -c 2000000 "$root/logs/run-detached.log" > "$out/run-detached.log"
    else
      echo "the detached run has ended"
      cp -r "$root/out/." "$out/" 2>/dev/null || true
      tail -c 2000000 "$root/logs/run-detached.log" > "$out/run-detached.log" 2>/dev/null || true
    fi
    tail -n 30 "$root/logs/run-detached.log" 2>/dev/null || true
    ;;
  fullscale-stacks)
    # Every engine's Python stack every 15 s, until the machine goes.
    set +e +o pipefail
    while sleep 15; do
      for pid in $(pgrep -f EngineCore); do date -u +%T; "$TOOLS/bin/py-spy" dump --pid "$pid" | head -40; done
    done
    ;;
  tier-start)
    shift
    mkdir -p "$TIER/cache"
    rm -rf "$TIER/exit" "$TIER/repo"
    # A copy of the checkout of its own: the next call's copy of the working tree may be
    # rewritten while the tier's processes read it.
    mkdir -p "$TIER/repo"
    tar -C "$PWD" --exclude=./.device-payload --exclude=./.whl --exclude=./.git -cf - . | tar -C "$TIER/repo" -xf -
    (cd "$TIER/repo" && setsid nohup tests/gpu/lent_machine.sh tier-run "$@" < /dev/null > "$TIER/tier.log" 2>&1 &)
    pgrep -f "lent_machine.sh tier-sample" > /dev/null || setsid nohup "$0" tier-sample < /dev/null > /dev/null 2>&1 &
    echo "tier started in the background: $TIER/tier.log"
    ;;
  tier-run)
    shift
    export PYTHONPATH="$PWD:$SITE:$TOOLS" PYTHONUNBUFFERED=1 QWEN38_GPU_REPORT="$TIER/report.json" \
      QWEN38_GPU_CACHE_DIR="${QWEN38_TIER_CACHE:-$TIER/cache}" PYTHON=python3
    if [ -n "${QWEN38_TIER_AFTER:-}" ]; then
      held=$(( $(date +%s) + 1200 ))
      until grep -Eq "$QWEN38_TIER_AFTER" "$TIER_ROOT/tier.log" 2>/dev/null || [ "$(date +%s)" -ge "$held" ]; do sleep 5; done
      echo "lane ${QWEN38_TIER_LANE:-}: starting at $(date -u +%T) (after /$QWEN38_TIER_AFTER/)"
    fi
    code=0
    tests/gpu/run_tier.sh "$@" || code=$?
    echo "$code" > "$TIER/exit"
    ;;
  tier-sample)
    # What is running, every 15 s: compilers (nvcc, ptxas, cicc: JIT builds) and GPU memory.
    # No errexit/pipefail here: a process that ends between pgrep and ps makes ps fail, and
    # that ended the sampler 4 minutes into the 2026-12-01 runs.
    set +e +o pipefail
    while compgen -G "$TIER_ROOT*/repo" > /dev/null && ! all_lanes_done; do
      { date -u +%T
        pids=$(pgrep -d, -f "nvcc|ptxas|cicc|ninja|VLLM|EngineCore|pytest" || true)
        if [ -n "$pids" ]; then ps -o etimes,pcpu,rss,args --sort=-pcpu -p "$pids" | cut -c1-200 | head -12; fi
        nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
        # Where each engine process is, when py-spy came with the tools.
        if [ -x "$TOOLS/bin/py-spy" ]; then
          for pid in $(pgrep -f "VLLM::EngineCore" || true); do
            "$TOOLS/bin/py-spy" dump --pid "$pid" 2>&1 | grep -v "^ *$" | head -25
          done
        fi
      } >> "$TIER_ROOT/sampler.log" 2>&1
      sleep 15
    done
    ;;
  tier-wait)
    deadline=$(( $(date +%s) + ${2:?seconds} ))
    while ! all_lanes_done && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    out=${OUT:-$TIER_ROOT/out}; mkdir -p "$out"
    tail -c 2000000 "$TIER_ROOT/sampler.log" > "$out/sampler.log" 2>/dev/null || true
    find /tmp/pytest-of-*/ -name serve.log 2>/dev/null | tar -cJf "$out/serve-logs.tar.xz" -T - 2>/dev/null || true
    for lane in "$TIER_ROOT" "$TIER_ROOT"-*; do
      [ -d "$lane/repo" ] || continue
      name=$(basename "$lane"); mkdir -p "$out/$name"
      cp "$lane/report.json" "$out/$name/" 2>/dev/null || true
      tail -c 4000000 "$lane/tier.log" > "$out/$name/tier.log" 2>/dev/null || true
      du -sh "$lane/cache" 2>/dev/null || true
      if [ -e "$lane/exit" ]; then echo "$name finished: exit $(cat "$lane/exit")"; else echo "$name still running"; fi
      tail -n 25 "$lane/tier.log"
    done
    ;;
  *)
    echo "usage: $0 stage|tools|install|env|fullscale-prep SERVED|fullscale-start ARGS|fullscale-wait SECONDS|tier-start [FILES]|tier-wait SECONDS" >&2
    exit 2
    ;;
esac
