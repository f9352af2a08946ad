#!/usr/bin/env bash
# Repack the slim vLLM payload (../shared/tools/gpu-payload.sh OUTDIR: a tar of the vllm wheel
# and ~100 dependency wheels, cut into parts) into fewer, smaller parts for the lent GPU machine:
# everything installed into one site directory for Python 3.12 here, then one xz stream of that
# tree (python3's lzma unpacks it there; no xz binary needed), cut into 59 MiB parts, so that a
# part plus this checkout stays under the 64 MiB a call carries. Measured 2026-12-01: the 281 MB
# payload installs to an 823 MB site that packs to 192 MiB (3 x 59 MiB + 15 MiB: 4 calls, the last
# one with room for .whl), in 10 min 22 s on a loaded 2-vCPU machine (4 min 0 s with FA3 on an idle
# Zen 5 one, 2026-12-02: 203 MiB); unpacking it took 24 s here.
#   tests/gpu/pack_site.sh PAYLOAD_DIR OUTDIR [VLLM_WHEEL]
# VLLM_WHEEL (the full vllm-0.28.0 wheel; `pip download` it as gpu-payload.sh does) puts back the
# FlashAttention 3 library the slim payload leaves out (153 MB, sm_90 code, 11 MB in xz): without
# it vLLM runs FlashAttention 2 on the H100/H200, whose wheel has sm_80 code only, and the driver
# compiles every FA2 kernel from PTX at its first launch (~200 s of a tiny profile's first start
# on the lent H200, 2026-12-02; a 3090 runs the sm_80 code as it is).
set -euo pipefail
usage="usage: pack_site.sh PAYLOAD_DIR OUTDIR [VLLM_WHEEL]"
IN=${1:?$usage}; OUT=${2:?$usage}; WHEEL=${3:-}
FA3=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
if [[ -n "$WHEEL" ]] && ! unzip -l "$WHEEL" "$FA3" > /dev/null 2>&1; then
  echo "pack_site.sh: $WHEEL is not a vLLM wheel holding $FA3" >&2
  exit 2
fi
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cat "$IN"/part_* | tar -C "$W" -xf -
mkdir -p "$W/site"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$W/payload/vllm-slim.zip" "$W/site"
python3 -m pip install -q --disable-pip-version-check --no-deps --no-index --no-compile --target "$W/site" \
  --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 --platform any \
  "$W"/payload/deps/*.whl
if [[ -n "$WHEEL" ]]; then unzip -q -o "$WHEEL" "$FA3" -d "$W/site"; fi
mkdir -p "$OUT"; rm -f "$OUT"/site_*
tar -C "$W/site" -cf - . | xz -6 -T2 | split -b 59M -d - "$OUT/site_"
du -sh "$W/site"; ls -l "$OUT"
