#!/usr/bin/env bash
# Regenerate results/README.md and results/report/ from scratch, for SmolLM2-135M and gemma-3-270m: the sweeps
# behind the report's figures, task accuracy and end-to-end latency cells, `python -m kvbench report`, and the
# README's tables. 35 minutes on this 2-core machine with nothing else running (each step's time goes to
# results/reproduce.log).
#
#   scripts/reproduce.sh                      # everything above, both models (35 minutes)
#   MODELS=smollm2_135m scripts/reproduce.sh  # one model
#   QUICK=1 scripts/reproduce.sh              # minutes: one short window per cell, few cells
#   FINDINGS=1 scripts/reproduce.sh           # also the per-part studies behind results/<part>.md (hours)
#   KEEP_TRACES=1 scripts/reproduce.sh        # reuse captured traces in $KVBENCH_HOME (default: capture afresh)
#   RESULTS=/tmp/r QUICK=1 scripts/reproduce.sh   # somewhere else than results/ (a smoke test of this script)
#
# The sweeps' runs go to $RESULTS/sweeps/reproduce/runs (git-ignored), emptied at the start; the per-part studies
# (FINDINGS=1: scripts/per_vector.py, sequential.py, prefix_sharing.py, accuracy.py, latency.py, frontier.py,
# eviction.py, each running the presets configs/experiment/<part>*.yaml) keep their own runs under $RESULTS/runs
# ($RESULTS/sweeps/sequential for sequential) and reuse finished cells; their tables and figures are sections of
# $RESULTS/report beside the overview. Every timed cell runs under the machine's benchmark lock, so its
# encode/decode times are not shared with other jobs that take the lock.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MODELS=${MODELS:-"smollm2_135m gemma3_270m"}
LOCK=${LOCK:-/tmp/kvbench-bench.lock}
HOME_DIR=${KVBENCH_HOME:-$HOME/.cache/kvbench}
RESULTS=${RESULTS:-results}  # committed findings live in results/; results/runs and results/sweeps are ignored
SWEEPS=$RESULTS/sweeps/reproduce
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
# every sweep cell and eval/latency run of this script writes under $SWEEPS
sweep() { KVBENCH_RESULTS=$SWEEPS locked "$PY" -m kvbench run -m "$@"; }
kvb() { KVBENCH_RESULTS=$SWEEPS locked "$PY" -m kvbench "$@"; }

# Per model: data size of the sweeps (the run defaults, 4 x 1024 tokens), context lengths (gemma-3-270m's stop at
# 1024: it costs several times SmolLM2's time per token here, 262k-token vocabulary and 640-wide layers),
# TurboQuant variants, share rates. Delta and recompute code token by token (seconds per sequence): the bound
# sweep runs delta at the model's data size and the model-running coders (recompute, and speculative: delta
# coding whose predictor is a copy of the model) on one 256-token window.
if [[ "${QUICK:-0}" == 1 ]]; then
    DATA_smollm2_135m="dataset.n_sequences=1 dataset.n_calib=1 dataset.seq_len=256 dataset.eval_len=32"
    DATA_gemma3_270m=$DATA_smollm2_135m
    CTX_smollm2_135m=128,256
    CTX_gemma3_270m=128,256
    KIVI_BITS=2,4
    TQ_BITS=2,3
    TQ_VARIANTS_smollm2_135m=mse,prod
    TQ_VARIANTS_gemma3_270m=mse
    SHARE_smollm2_135m=0.0,0.3  # 8 sessions of the four families reach about 0.4
    SHARE_gemma3_270m=0.0,0.3
    SESSIONS=8
    EVAL=(tasks=[sotu_lastword,passkey] passkey.lengths=[1024] limit=3)
    LATENCY=(latency.contexts=[256] latency.decode_tokens=8)
    LATENCY_RECOMPUTE=(latency.contexts=[128] latency.decode_tokens=2)
else
    DATA_smollm2_135m=""
    DATA_gemma3_270m=""
    CTX_smollm2_135m=256,512,1024,2048
    CTX_gemma3_270m=256,512,1024
    KIVI_BITS=2,3,4,8
    TQ_BITS=2,2.5,3,3.5,4
    TQ_VARIANTS_smollm2_135m=mse,prod
    TQ_VARIANTS_gemma3_270m=mse
    SHARE_smollm2_135m=0.0,0.2,0.4,0.6
    SHARE_gemma3_270m=0.0,0.3,0.6
    SESSIONS=32
    EVAL=()     # configs/eval.yaml: six tasks, 30 examples each, passkey at 1k, 2k and 4k tokens
    LATENCY=()  # configs/latency.yaml: contexts 512, 2048 and 4096, 64 decoded tokens
    # recompute re-runs the prefill on every read: one short context is enough to see the price
    LATENCY_RECOMPUTE=(latency.contexts=[512] latency.decode_tokens=4)
fi
ONE_WINDOW=(dataset.n_sequences=1 dataset.n_calib=1 dataset.seq_len=256)

log "kvbench reproduce: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvbench compressors configs || echo -dirty)," \
    "models: $MODELS, quick: ${QUICK:-0}, findings: ${FINDINGS:-0}, $(nproc) cores"
T0=$SECONDS

"$PY" -m kvbench assets --model smollm2_135m --model gemma3_270m --data sotu --data bigbench

# From scratch: this script's runs and README, traces too unless KEEP_TRACES=1; the report too when the studies
# write their sections again (without FINDINGS=1 the overview is rewritten in place beside their committed sections).
rm -rf "$SWEEPS"
if [[ "${FINDINGS:-0}" == 1 ]]; then
    rm -rf "$RESULTS/report"
fi
if [[ "${KEEP_TRACES:-0}" != 1 ]]; then
    rm -rf "$HOME_DIR/traces" "$HOME_DIR/sessions"
fi

# 1. Optional: the per-part studies (results/<part>.md, sections of results/report/). They need the packaged models
#    and run for an hour or more each (recompute and the model predictor decode token by token at 4 x 1024 tokens).
if [[ "${FINDINGS:-0}" == 1 ]]; then
    for script in per_vector sequential prefix_sharing accuracy latency frontier eviction; do
        if [[ ! -f scripts/$script.py ]]; then
            log "error: scripts/$script.py is missing; its findings cannot be regenerated"
            exit 1
        fi
    done
    # each takes the benchmark lock for every cell it times (not around itself: that would lock its own cells
    # out); accuracy times nothing
    study() { KVBENCH_RESULTS=$RESULTS "$PY" "scripts/$1.py"; }
    step "per-vector (SmolLM2)" study per_vector
    step "sequential (SmolLM2)" study sequential
    step "prefix sharing (SmolLM2)" study prefix_sharing
    step "accuracy (SmolLM2)" study accuracy
    step "latency (SmolLM2)" study latency
    step "frontier (SmolLM2, gemma)" study frontier
    step "eviction (SmolLM2, gemma)" study eviction
fi

# 2. Sweeps behind the report's figures, per model (presets in configs/experiment/).
for m in $MODELS; do
    data_var=DATA_$m ctx_var=CTX_$m tqv_var=TQ_VARIANTS_$m share_var=SHARE_$m
    read -r -a data <<< "${!data_var}"
    ctx=${!ctx_var} tqv=${!tqv_var} share=${!share_var}
    step "rate-distortion kivi ($m)" sweep +experiment=rate_distortion model="$m" "${data[@]}" \
        +compressor=kivi compressor.bits="$KIVI_BITS"
    step "rate-distortion turboquant ($m)" sweep +experiment=rate_distortion model="$m" "${data[@]}" \
        +compressor=turboquant compressor.bits="$TQ_BITS" compressor.variant="$tqv"
    step "context length ($m)" sweep +experiment=context_length model="$m" "${data[@]}" dataset.seq_len="$ctx"
    step "bound: 16-bit, lossless, delta ($m)" sweep +experiment=bound model="$m" "${data[@]}" \
        +compressor=identity,lossless,delta
    step "bound: delta with per-channel steps ($m)" sweep +experiment=bound model="$m" "${data[@]}" +compressor=delta \
        compressor.bits=2,3
    step "bound: coders that run the model ($m)" sweep +experiment=bound model="$m" "${ONE_WINDOW[@]}" \
        +compressor=identity,recompute
    step "speculative: delta, model predictor ($m)" sweep +experiment=bound model="$m" "${ONE_WINDOW[@]}" \
        +compressor=speculative compressor.step=0,0.1
    step "prefix sharing ($m)" sweep +experiment=prefix_sharing model="$m" workload.n_sessions=$SESSIONS \
        +compressor=trie workload.target_share_rate="$share"
done

# 3. The compressed cache in the loop (SmolLM2): task accuracy and end-to-end latency against the 16-bit cache.
for c in "identity" "kivi compressor.bits=2" "turboquant compressor.bits=2.5"; do
    read -r -a comp <<< "$c"
    step "accuracy ${comp[0]}" kvb eval "+compressor=${comp[0]}" "${comp[@]:1}" "${EVAL[@]}"
    step "latency ${comp[0]}" kvb latency "+compressor=${comp[0]}" "${comp[@]:1}" "${LATENCY[@]}"
done
step "latency recompute" kvb latency +compressor=recompute "${LATENCY_RECOMPUTE[@]}"

# 4. One table and the figures from every cell, then results/README.md (hand-written findings are kept).
step report "$PY" -m kvbench report "$SWEEPS/runs" --out "$RESULTS/report"
step readme "$PY" scripts/results_readme.py --runs "$SWEEPS/runs" --report "$RESULTS/report" --out "$RESULTS/README.md"
log "done in $(( (SECONDS - T0) / 60 )) min"
if (( ${#FAILED[@]} )); then
    log "failed steps: ${FAILED[*]}"
    exit 1
fi
