#!/usr/bin/env bash
# #46 item 1 in one device call: the train step at BERT-Base seq 128 with Inductor's autotuned
# GEMMs (Triton templates with the bias/GELU epilogues fused in, chosen by timing on the card),
# then the default compile at twice the batch. Both models get the same mode, so the ratio stays
# ours/transformers under equal compilation. Each result is a JSON line in $OUT/bench.jsonl.
#   OUT=/tmp/out bash bench/gpu_mfu.sh
set -u
OUT=${OUT:-/tmp/gpu-mfu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_COMPILE_THREADS=16
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
bench() {  # seconds, then the bench's arguments; a line per result, errors in err.log
    local limit=$1
    shift
    timeout "$limit" python3 "$@" 2>>"$OUT/err.log" | tee -a "$OUT/bench.jsonl"
}
bench 330 bench/model_step.py --preset base --seq-len 128 --batch-size 256 \
    --compile-mode max-autotune-no-cudagraphs --profile
bench 140 bench/model_step.py --preset base --seq-len 128 --batch-size 512 --compile
grep -v -i -E "autotun|benchmark|^\s*$" "$OUT/err.log" | tail -n 20
