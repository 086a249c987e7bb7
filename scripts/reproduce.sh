#!/usr/bin/env bash
# Regenerate results/README.md and its report (results/report/readme/) from scratch, for SmolLM2-135M and
# gemma-3-270m: the frontier (every coder family, paired 95% intervals), eviction beside it, RULER accuracy with
# intervals, the resident cache's decode speed against DynamicCache and transformers' QuantizedCache, restore
# time-to-first-token crossovers, cross-session prefix sharing and the entropy bound. The wall time goes into the
# README's header and results/reproduce.log (the measured lane takes a model's RULER cells once its own are done;
# each model's RULER cells run in one process that answers the 16-bit baselines once). To fit a tighter budget:
# MODELS=smollm2_135m (about half).
#
#   scripts/reproduce.sh                      # everything above, both models
#   make reproduce                            # the same, after installing what it needs (the hqq extra)
#   MODELS=smollm2_135m scripts/reproduce.sh  # one model
#   QUICK=1 scripts/reproduce.sh              # minutes: short windows, one RULER example per task
#   FINDINGS=1 scripts/reproduce.sh           # also the whole per-part studies behind results/<part>.md (hours)
#   KEEP_TRACES=1 scripts/reproduce.sh        # reuse captured traces in $KVBENCH_HOME (default: capture afresh)
#   RESULTS=/tmp/r QUICK=1 scripts/reproduce.sh   # somewhere else than results/ (a smoke test of this script)
#   ALLOW_MIXED=1 scripts/reproduce.sh        # publish evidence from a dirty tree (the pages then say so)
#
# The runs behind results/README.md are published as the study `reproduce` (results/evidence/reproduce/: each
# run's summary and per-token NLLs) and the README is rebuilt from that evidence alone, as `python -m kvbench report
# --check` rebuilds it; its hand-written findings live in results/evidence/pages/README.md (made from the README's
# findings the first time, when each figure typed in them is reported until it is rewritten as a reference into the
# evidence). The evidence is of one clean commit: on a dirty tree this script refuses to publish unless ALLOW_MIXED=1.
#
# The README's cells are cells of the per-part studies (the `reproduce` patterns of configs/study/frontier.yaml,
# eviction.yaml and ruler.yaml, run by scripts/frontier.py, eviction.py, ruler.py with --only: the same configs, so the
# same cell keys as results/frontier.md etc.), measured afresh under
# $RESULTS/sweeps/reproduce/runs (git-ignored, emptied at the start). Two lanes run side by side, one torch thread
# each: the measured lane (every cell whose encode/decode or latency is reported, each under the machine's benchmark
# lock) and the accuracy lane (RULER cells, nothing of them timed; the measured lane takes RULER cells too once its own
# are done). A timed cell therefore shares the
# machine with one single-thread job; results/latency.md and scripts/bench_*.py have the quiet-machine figures.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MODELS=${MODELS:-"smollm2_135m gemma3_270m"}
LOCK=${LOCK:-/tmp/kvbench-bench.lock}
HOME_DIR=${KVBENCH_HOME:-$HOME/.cache/kvbench}
RESULTS=${RESULTS:-results}  # committed findings live in results/; results/runs and results/sweeps are ignored
SWEEPS=$RESULTS/sweeps/reproduce
LOG=$RESULTS/sweeps/reproduce.log  # git-ignored: a page cites only its evidence
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

mkdir -p "$RESULTS" "$(dirname "$LOG")"
: > "$LOG"
FAILED=$(mktemp)
log() { echo "$*" | tee -a "$LOG"; }
step() {  # step NAME CMD...: run, time and log it; on failure note it and go on (a study runs its other cells)
    local name=$1 t0=$SECONDS rc=0
    shift
    log "== $(date +%H:%M:%S) $name: $*"
    "$@" >> "$RESULTS/reproduce.$LANE.out" 2>&1 || rc=$?
    log "   $name: $((SECONDS - t0)) s$([[ $rc == 0 ]] || echo ", FAILED (exit $rc; see $RESULTS/reproduce.$LANE.out)")"
    [[ $rc == 0 ]] || echo "$name" >> "$FAILED"
}
# every cell of this script writes under $SWEEPS; the study drivers take the lock per measured cell themselves
MIXED=()
[[ "${ALLOW_MIXED:-0}" == 1 ]] && MIXED=(--allow-mixed)
study() { local s=$1; shift; "$PY" "scripts/$s.py" "${MIXED[@]}" "paths.results=$SWEEPS" "$@"; }
kvb() { KVBENCH_RESULTS=$SWEEPS flock "$LOCK" "$PY" -m kvbench "$@"; }
sweep() { kvb run -m "$@"; }

if [[ "${QUICK:-0}" == 1 ]]; then
    SIZE=(dataset.n_sequences=1 dataset.n_calib=1 dataset.seq_len=512 dataset.eval_len=64)
    RULER_SIZE=("${SIZE[@]}" limit=1)
    SESSIONS=8 SHARE=0.0,0.3
    LATENCY=(latency.contexts=[256] latency.decode_tokens=4)
    RESTORE=(restore.contexts=[256] restore.repeats=1)
else
    SIZE=()          # the run defaults: 4 windows of 1,024 tokens, each scored on its next 512 tokens
    RULER_SIZE=()    # the ruler presets: 5 examples per task at 1,024 tokens
    SESSIONS=32 SHARE=0.0,0.3,0.6
    LATENCY=(latency.contexts=[1024,4096] latency.decode_tokens=32)
    RESTORE=(restore.contexts=[1024,4096])
fi
ONE_WINDOW=(dataset.n_sequences=1 dataset.n_calib=1 dataset.seq_len=256)
# the report picks each section's cells by their configs, so it is told the sizes they were run with
SIZED=()
for o in "${RULER_SIZE[@]}"; do SIZED+=(--override "$o"); done

# The cells of the README, per model: the `reproduce` patterns of configs/study/{frontier,eviction,ruler}.yaml (each
# a cell of that study, picked with --only), read once here so that a config that does not load stops the script.
declare -A ONLY
for m in $MODELS; do
    for s in frontier eviction ruler; do
        ONLY[$s.$m]=$("$PY" -m kvbench.sweep.studies_config reproduce "$s" "$m")
        [[ -n ${ONLY[$s.$m]} ]] || { log "error: configs/study/$s.yaml lists no reproduce cell for $m"; exit 1; }
    done
done

SHA=$(git rev-parse --short HEAD)
log "kvbench reproduce: $SHA$(git diff --quiet HEAD -- kvbench compressors configs scripts || echo -dirty)," \
    "models: $MODELS, quick: ${QUICK:-0}, findings: ${FINDINGS:-0}, $(nproc --all) cores"
T0=$SECONDS

LANE=setup
step assets "$PY" -m kvbench assets --model smollm2_135m --model gemma3_270m --data sotu
if ! "$PY" -c "import hqq" 2>/dev/null; then
    log "error: the QuantizedCache baseline needs hqq: $PY -m pip install -e '.[hqq]' (or: make reproduce)"
    exit 1
fi

# From scratch: this script's runs, traces too unless KEEP_TRACES=1, and the whole report when the studies run.
rm -rf "$SWEEPS" "$RESULTS/report/readme" "$RESULTS"/reproduce.*.out
if [[ "${FINDINGS:-0}" == 1 ]]; then
    rm -rf "$RESULTS/report"
fi
if [[ "${KEEP_TRACES:-0}" != 1 ]]; then
    rm -rf "$HOME_DIR/traces" "$HOME_DIR/sessions"
fi

only() { local a=(); while read -r line; do a+=(--only "$line"); done; printf '%s\n' "${a[@]}"; }

lane_measured() {
    LANE=measured
    for m in $MODELS; do
        mapfile -t sel < <(only <<< "${ONLY[frontier.$m]}")
        step "frontier ($m)" study frontier "${sel[@]}" "${SIZE[@]}"
        mapfile -t sel < <(only <<< "${ONLY[eviction.$m]}")
        step "eviction ($m)" study eviction "${sel[@]}" "${SIZE[@]}"
        # beside the bound: coders of the sequential study (configs/study/sequential.yaml) at their defaults
        step "bound: 16-bit, lossless, exact delta ($m)" sweep model="$m" "${SIZE[@]}" \
            +compressor=identity,lossless,delta
        step "bound: coders that run the model ($m)" sweep model="$m" "${ONE_WINDOW[@]}" \
            +compressor=identity,recompute
        step "speculative: delta, model predictor ($m)" sweep model="$m" "${ONE_WINDOW[@]}" \
            +compressor=speculative compressor.step=0.1
        # transformers' QuantizedCache takes models whose layers all attend fully: not gemma-3's sliding layers
        local baseline=() with=""
        if [[ $m != gemma3_270m ]]; then baseline=("latency.baselines=[transformers_quantized]") with=", QuantizedCache"; fi
        step "latency: KIVI 2-bit resident, DynamicCache$with ($m)" kvb latency model="$m" \
            +compressor=kivi compressor.bits=2 "${baseline[@]}" "${LATENCY[@]}"
        # exact dedup at block 16 against the share rate: prefix_sharing_sweep's cells, at $SESSIONS sessions
        step "prefix sharing ($m)" sweep +experiment=prefix_sharing_sweep model="$m" workload.n_sessions=$SESSIONS +compressor=trie \
            "compressor={block_size:16}" workload.target_share_rate=$SHARE
        for c in "kivi compressor.bits=2" "turboquant compressor.bits=3"; do
            read -r -a comp <<< "$c"
            step "restore ${comp[0]} ($m)" kvb restore model="$m" "+compressor=${comp[0]}" "${comp[@]:1}" \
                restore.threads=1 "${RESTORE[@]}"
        done
    done
    lane_ruler
}

# RULER is shared out a model at a time (a queue under a lock), so the measured lane takes its share once its own
# cells are done instead of leaving a core idle. A model's RULER cells run in one process: the 16-bit baseline of
# each example does not depend on the compressor, and the process answers it once for all of them.
RULER_QUEUE=$(mktemp)
for m in $MODELS; do echo "$m $(paste -sd '\t' <<< "${ONLY[ruler.$m]}")"; done > "$RULER_QUEUE"
ruler_next() { flock "$RULER_QUEUE.lock" sh -c 'head -n 1 "$1"; sed -i 1d "$1"' _ "$RULER_QUEUE"; }
lane_ruler() {
    local item m sel
    while item=$(ruler_next) && [[ -n $item ]]; do
        m=${item%% *}
        mapfile -t sel < <(only <<< "$(tr '\t' '\n' <<< "${item#* }")")
        step "RULER ($m)" study ruler "${sel[@]}" model="$m" "${RULER_SIZE[@]}"
    done
}

lane_accuracy() {
    LANE=accuracy
    lane_ruler
}

# 1. Optional: the whole per-part studies (results/<part>.md, sections of results/report/), hours in all.
if [[ "${FINDINGS:-0}" == 1 ]]; then
    LANE=findings
    for s in per_vector sequential prefix_sharing accuracy latency frontier eviction ruler; do
        step "study $s" env KVBENCH_RESULTS="$RESULTS" "$PY" "scripts/$s.py" "${MIXED[@]}"
    done
fi

# 2. The README's cells, in two lanes.
lane_measured &
MEASURED=$!
lane_accuracy &
ACCURACY=$!
wait $MEASURED || true
wait $ACCURACY || true

# 3. Every cell's run published as the evidence of results/README.md, then the README, its tables and figures
# (results/report/readme/) rebuilt from that evidence alone; the hand-written findings are its source's.
LANE=report
WALL=$(( (SECONDS - T0 + 59) / 60 ))
report() { KVBENCH_RESULTS="$RESULTS" "$PY" -m kvbench report "$@"; }
step evidence report --export-evidence reproduce "$SWEEPS/runs" --wall-min "$WALL" "${SIZED[@]}" "${MIXED[@]}"
if [[ ! -f "$RESULTS/evidence/pages/README.md" ]]; then  # once: the README's findings become its source
    step register report --register README.md --study reproduce
fi
step readme report --pages README.md
log "done in $(( (SECONDS - T0 + 59) / 60 )) min"
if [[ -s "$FAILED" ]]; then
    log "failed steps: $(paste -sd, "$FAILED")"
    exit 1
fi
