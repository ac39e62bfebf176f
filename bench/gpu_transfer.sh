#!/usr/bin/env bash
# The GPU run of #46 in one device call, every figure a JSON line in $OUT/bench.jsonl and the
# runs' curves copied into $OUT: GLUE fine-tuning, ours against transformers (bench/glue_parity.py,
# from a random `PRESET` model: speed, and any divergence), Ray Train on
# the GPU against the bare loop (RAY_BENCH=1), both pre-training phases (128 then 512 tokens from
# its weights, as docs/transfer.md's recipe runs them; with STOP_RESUME=1 the first phase stopped
# and resumed once: a checkpoint round trip on the GPU), then SST-2, MRPC and STS-B fine-tuned
# from that model and from random weights, side by side in one `bert evaluate` table.
# The pre-training steps come from the rate the Ray bench measured, so each phase fills its share
# of the call's time (PHASE1_S, PHASE2_S seconds of training).
#   CORPUS=runs/gpu/corpus VOCAB=runs/gpu/vocab GLUE=../shared/data/glue OUT=/tmp/out \
#       bash bench/gpu_transfer.sh
# The same script runs on a CPU at toy scale (SMOKE=1) to check the chain before a device call.
set -u
OUT=${OUT:-/tmp/gpu-checks}
R=${RUNS:-/tmp/gpu-runs}
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD MLFLOW_DISABLE_TELEMETRY=true
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-sqlite:///$R/mlflow.db}
PY=${PY:-python3}
BERT="$PY -m bert_core"
PRESET=${PRESET:-mini}
BATCH=${BATCH:-256}
PHASE1_S=${PHASE1_S:-100}
PHASE2_S=${PHASE2_S:-30}
LR=${LR:-2e-4}
RAY_BENCH=${RAY_BENCH:-0}
STOP_RESUME=${STOP_RESUME:-0}
if [ -n "${SMOKE:-}" ]; then
    GPU=() DEV=cpu BENCH_STEPS=40 LOG=10 DUPE=1 FT=(--max-train-examples 64 --max-eval-examples 64
        --epochs 1) SWEEP=1e-3 BATCH=8 PRESET=tiny PARITY=(--sst2-sample 64 --epochs 1
        --max-train-examples 64 --max-eval-examples 64)
else
    GPU=(--use-gpu --compile) DEV=cuda BENCH_STEPS=300 LOG=50 DUPE=5 FT=(--epochs 2 --max-train-examples 20000) SWEEP=3e-4,1e-4
    PARITY=(--sst2-sample 20000 --epochs 2)
fi
log() { echo "[gpu_transfer $(date +%T)] $*" | tee -a "$OUT/steps.log"; }
run() {  # seconds, name, command...: its output in $OUT/NAME.log, its status in steps.log
    local limit=$1 name=$2
    shift 2
    log "$name: start"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    log "$name: exit $rc"
    return $rc
}
log "start"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv \
    2>/dev/null | tee -a "$OUT/steps.log"
$PY -c "import torch, transformers, ray, mlflow; print('torch', torch.__version__, 'transformers',
    transformers.__version__, 'ray', ray.__version__, 'mlflow', mlflow.__version__)" \
    | tee -a "$OUT/steps.log"

# the instances, from the cleaned corpus and the vocabulary, on the device's CPUs while the GPU
# runs the fine-tuning bench below
run 240 inst128 $BERT instances --input "$CORPUS" --vocab "$VOCAB/vocab.txt" --output "$R/inst128" \
    --max-seq-length 128 --max-predictions-per-seq 20 --dupe-factor "$DUPE" --num-workers 6 &
inst128=$!
run 360 inst512 $BERT instances --input "$CORPUS" --vocab "$VOCAB/vocab.txt" --output "$R/inst512" \
    --max-seq-length 512 --max-predictions-per-seq 80 --dupe-factor "$DUPE" --num-workers 6 &
inst512=$!

# 2. fine-tuning, ours and transformers from one random model, at 1e-4 and at 1e-3
$PY - "$VOCAB/vocab.txt" "$R/init" "$PRESET" <<'PYEOF'
import sys, torch
from bert_core.model.config import BertConfig
from bert_core.model.modeling import BertForPreTraining
vocab, out, preset = sys.argv[1:]
n = sum(1 for _ in open(vocab, encoding="utf-8"))
torch.manual_seed(0)
BertForPreTraining(BertConfig.from_preset(preset, vocab_size=n)).save_pretrained(out, vocab)
PYEOF
run 150 glue_parity $PY bench/glue_parity.py --tasks SST-2 MRPC --data "$GLUE" --model "$R/init" \
    --learning-rate 1e-4 --batch-size 32 "${PARITY[@]}"
grep '^{' "$OUT/glue_parity.log" | tee -a "$OUT/bench.jsonl"
# the same at 1e-3, where the first GPU run's fine-tunings went NaN
run 120 glue_parity_1e-3 $PY bench/glue_parity.py --tasks SST-2 --data "$GLUE" --model "$R/init" \
    --learning-rate 1e-3 --batch-size 32 "${PARITY[@]}" --epochs 1
grep '^{' "$OUT/glue_parity_1e-3.log" | tee -a "$OUT/bench.jsonl"


wait "$inst128"

# 3. Ray Train on the GPU: one Ray worker against the bare loop, same set-up and step; without
# it, the rate the last one measured (docs/pretrain.md: 813k tokens/s through Ray, `mini`, H100)
RATE=${RATE:-813000}
if [ "$RAY_BENCH" = 1 ]; then
    run 150 ray_bench $PY bench/pretrain.py --instances "$R/inst128" --preset "$PRESET" \
        --batch-size "$BATCH" --steps "$BENCH_STEPS" --log-every "$LOG" --checkpoint-every 100 \
        --cpus-per-worker 4 "${GPU[@]}"
    grep '^{' "$OUT/ray_bench.log" | tee -a "$OUT/bench.jsonl"
    RATE=$(grep '^{' "$OUT/ray_bench.log" | $PY -c "import json,sys; print(json.load(sys.stdin)['bare_tokens_per_s'])" 2>/dev/null || echo "$RATE")
fi
steps_for() {  # seconds, tokens per sequence -> steps at the measured rate (at least 20)
    $PY -c "print(max(20, int($RATE * $1 / ($BATCH * $2))))"
}

# 4. phase one at 128 tokens (STOP_RESUME=1: stopped half-way and resumed, the checkpoint round
# trip), then phase two at 512 tokens from its weights (a quarter of the rate: 4x the tokens per sequence
# and the longer attention)
N1=$(steps_for "$PHASE1_S" 128)
N2=$(steps_for "$PHASE2_S" 512)
[ -n "${SMOKE:-}" ] && N1=20 N2=6
log "phase steps: $N1 at 128, $N2 at 512 (measured $RATE tokens/s)"
COMMON=(--preset "$PRESET" --batch-size "$BATCH" --learning-rate "$LR"
    --cpus-per-worker 4 --eval-sequences 512 "${GPU[@]}")
[ "$STOP_RESUME" = 1 ] && run 200 phase1a $BERT pretrain --instances "$R/inst128" --output "$R/pt1" "${COMMON[@]}" \
    --steps "$N1" --warmup-steps $((N1 / 10)) --stop-after $((N1 / 2)) --eval-every $((N1 / 10)) --log-every $((N1 / 10)) \
    --checkpoint-every $((N1 / 2))
run $((PHASE1_S + 120)) phase1b $BERT pretrain --instances "$R/inst128" --output "$R/pt1" "${COMMON[@]}" \
    --steps "$N1" --warmup-steps $((N1 / 10)) --eval-every $((N1 / 10)) --log-every $((N1 / 10)) \
    --checkpoint-every $((N1 / 2))
wait "$inst512"
grep -h "resumed from step" "$OUT/phase1b.log" | tee -a "$OUT/steps.log"
run $((PHASE2_S + 90)) phase2 $BERT pretrain --instances "$R/inst512" --output "$R/pt2" "${COMMON[@]}" \
    --steps "$N2" --eval-every $((N2 / 5 > 0 ? N2 / 5 : 1)) --log-every $((N2 / 5 > 0 ? N2 / 5 : 1)) \
    --checkpoint-every "$N2" --warmup-steps $((N2 / 10)) --init-model "$R/pt1/model"
for p in pt1 pt2; do
    for f in pretrain_metrics.csv heldout_metrics.csv; do
        cp "$R/$p/$f" "$OUT/$p-$f" 2>/dev/null
    done
done

# 5. transfer: each task from the phase-two model and from random weights, all six at once
pids=()
for T in SST-2 MRPC STS-B; do
    for I in pretrained random; do
        $BERT finetune --task "$T" --data "$GLUE/$T" --model "$R/pt2/model" --output "$R/ft-$I/$T" \
            --init "$I" --lr-sweep "$SWEEP" --batch-size 32 --device "$DEV" "${FT[@]}" \
            >"$OUT/ft-$I-$T.log" 2>&1 &
        pids+=($!)
    done
done
log "finetune: 6 jobs started"
( sleep "${FT_LIMIT_S:-130}"; kill "${pids[@]}" 2>/dev/null ) &
killer=$!
for p in "${pids[@]}"; do wait "$p"; done
kill "$killer" 2>/dev/null
log "finetune: done"
tail -n 3 "$OUT"/ft-*.log >"$OUT/finetune_tails.txt" 2>/dev/null
run 120 evaluate $BERT evaluate --results "$R"/ft-pretrained/* "$R"/ft-random/* \
    --output "$R/evaluate"
cp "$R/evaluate/glue_results.json" "$OUT/" 2>/dev/null
cat "$OUT/evaluate.log"
log "end"
