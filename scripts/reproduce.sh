#!/usr/bin/env bash
# Regenerate everything in results/ from scratch, for SmolLM2-135M and gemma-3-270m: the findings scripts of each
# part, the sweeps behind the report's figures, `python -m kvbench report`, and the draft of results/README.md.
# About an hour on a 2-core machine with nothing else running (each step's time goes to results/reproduce.log).
#
#   scripts/reproduce.sh                      # everything, both models
#   MODELS=smollm2_135m scripts/reproduce.sh  # one model
#   QUICK=1 scripts/reproduce.sh              # minutes: short windows, few cells, sweeps and report only
#   KEEP_TRACES=1 scripts/reproduce.sh        # reuse captured traces in $KVBENCH_HOME (default: capture afresh)
#   RESULTS=/tmp/r QUICK=1 scripts/reproduce.sh   # somewhere else than results/ (a smoke test of this script)
#
# Sweep cells run one at a time under the machine's benchmark lock, so their encode/decode times are not shared
# with other jobs (the findings scripts take that lock themselves where they time things). A cell whose summary
# already exists for the same config and code is reused: the findings scripts run first, and the sweeps below reuse
# any cell they share with them.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MODELS=${MODELS:-"smollm2_135m gemma3_270m"}
LOCK=${LOCK:-/tmp/kvbench-bench.lock}
HOME_DIR=${KVBENCH_HOME:-$HOME/.cache/kvbench}
RESULTS=${RESULTS:-results}  # committed findings live in results/; results/runs and results/sweeps are ignored
export KVBENCH_RESULTS=$RESULTS
LOG=$RESULTS/reproduce.log

mkdir -p "$RESULTS"
: > "$LOG"
log() { echo "$*" | tee -a "$LOG"; }
FAILED=()
step() {  # step NAME CMD...: run, time and log it; on failure note it and go on (a sweep runs its other cells)
    local name=$1 t0=$SECONDS rc=0
    shift
    log "== $(date +%H:%M:%S) $name: $*"
    "$@" || rc=$?
    log "   $name: $((SECONDS - t0)) s$([[ $rc == 0 ]] || echo ", FAILED (exit $rc)")"
    [[ $rc == 0 ]] || FAILED+=("$name")
}
locked() { flock "$LOCK" "$@"; }
sweep() { locked "$PY" -m kvbench run -m "$@" "${DATA[@]}"; }

if [[ "${QUICK:-0}" == 1 ]]; then
    DATA=(dataset.n_sequences=1 dataset.n_calib=1 dataset.eval_len=32)
    RD_SEQ=(dataset.seq_len=256)
    WORKLOAD=(workload.n_sessions=16)
    CTX_smollm2_135m=128,256
    CTX_gemma3_270m=128,256
    TQ_smollm2_135m=mse,prod
    TQ_gemma3_270m=mse
    SHARE_smollm2_135m=0.0,0.3,0.6
    SHARE_gemma3_270m=0.0,0.3,0.6
else
    DATA=()
    RD_SEQ=()
    WORKLOAD=()
    # gemma-3-270m costs several times SmolLM2's time per token here (262k-token vocabulary, 640-wide layers):
    # shorter contexts, TQ_mse only, three share rates
    CTX_smollm2_135m=256,512,1024,2048
    CTX_gemma3_270m=256,512,1024
    TQ_smollm2_135m=mse,prod
    TQ_gemma3_270m=mse
    SHARE_smollm2_135m=0.0,0.2,0.4,0.6
    SHARE_gemma3_270m=0.0,0.3,0.6
fi

log "kvbench reproduce: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvbench compressors configs || echo -dirty)," \
    "models: $MODELS, quick: ${QUICK:-0}, $(nproc) cores"
T0=$SECONDS

"$PY" -m kvbench assets --model smollm2_135m --model gemma3_270m --data sotu --data bigbench

# From scratch: every run, sweep log and report; traces too unless KEEP_TRACES=1.
rm -rf "$RESULTS/runs" "$RESULTS/sweeps" "$RESULTS/report"
if [[ "${KEEP_TRACES:-0}" != 1 ]]; then
    rm -rf "$HOME_DIR/traces" "$HOME_DIR/sessions"
fi

# 1. The findings of each part: results/<part>.md and results/figures/. They need the packaged models and
#    run for minutes each; QUICK=1 leaves them out.
if [[ "${QUICK:-0}" != 1 ]]; then
    for script in per_vector sequential prefix_sharing accuracy latency; do
        if [[ ! -f scripts/$script.py ]]; then
            log "error: scripts/$script.py is missing; its findings cannot be regenerated"
            exit 1
        fi
    done
    # sequential.py and latency.py take the benchmark lock per cell themselves; accuracy times nothing
    step "per-vector (SmolLM2)" locked "$PY" scripts/per_vector.py
    step "sequential (SmolLM2)" "$PY" scripts/sequential.py
    step "prefix sharing (SmolLM2)" locked "$PY" scripts/prefix_sharing.py run
    step "prefix sharing figures" "$PY" scripts/prefix_sharing.py figures
    step "accuracy (SmolLM2)" "$PY" scripts/accuracy.py
    step "latency (SmolLM2)" "$PY" scripts/latency.py
fi

# 2. Sweeps behind the report's figures, per model (presets in configs/experiment/). On SmolLM2 most cells are
#    the findings scripts' own and are reused; gemma-3-270m gets the same set. Delta and recompute code token by
#    token (seconds per sequence), so they run at the default context only.
for m in $MODELS; do
    ctx_var=CTX_$m tq_var=TQ_$m share_var=SHARE_$m
    ctx=${!ctx_var} tq=${!tq_var} share=${!share_var}
    step "rate-distortion kivi ($m)" sweep +experiment=rate_distortion model="$m" "${RD_SEQ[@]}" \
        +compressor=kivi compressor.bits=2,3,4,8
    step "rate-distortion turboquant ($m)" sweep +experiment=rate_distortion model="$m" "${RD_SEQ[@]}" \
        +compressor=turboquant compressor.bits=2,2.5,3,3.5,4 compressor.variant="$tq"
    step "context length ($m)" sweep +experiment=context_length model="$m" dataset.seq_len="$ctx"
    step "bound ($m)" sweep +experiment=bound model="$m" "${RD_SEQ[@]}"
    step "prefix sharing ($m)" sweep +experiment=prefix_sharing model="$m" "${WORKLOAD[@]}" +compressor=trie \
        workload.target_share_rate="$share"
done

# 3. One table and the figures from every cell, then the draft of results/README.md.
step report "$PY" -m kvbench report "$RESULTS/runs" --out "$RESULTS/report"
step readme "$PY" scripts/results_readme.py --runs "$RESULTS/runs" --report "$RESULTS/report" --out "$RESULTS/README.md"
log "done in $(( (SECONDS - T0) / 60 )) min"
if (( ${#FAILED[@]} )); then
    log "failed steps: ${FAILED[*]}"
    exit 1
fi
