#!/usr/bin/env bash
# The GPU checks of #31 in one device call, every figure a JSON line in $OUT/bench.jsonl:
# bf16 numerics (mini), then the train step against transformers at BERT-Base seq 128 (with a
# profile), seq 512 and BERT-Large, and, when BASELINE names a copy of an older tree, BERT-Base
# seq 128 of that tree (the change's effect on the same card in the same call).
#   OUT=/tmp/out INSTANCES=runs/dvc/instances BASELINE=/path/to/old/tree bash bench/gpu_checks.sh
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
bench() {  # seconds, then the bench's arguments; a line per result, errors in err.log
    local limit=$1
    shift
    timeout "$limit" python3 "$@" 2>>"$OUT/err.log" | tee -a "$OUT/bench.jsonl"
}
bench 120 bench/bf16_numerics.py --instances "${INSTANCES:-runs/dvc/instances}" --preset mini \
    --steps 600 --batch-size 128
bench 200 bench/model_step.py --preset base --seq-len 128 --batch-size 256 --compile --profile
if [ -n "${BASELINE:-}" ]; then
    (cd "$BASELINE" && PYTHONPATH=$PWD bench 200 bench/model_step.py --preset base --seq-len 128 \
        --batch-size 256 --compile)
fi
bench 200 bench/model_step.py --preset base --seq-len 512 --batch-size 64 --compile
bench 240 bench/model_step.py --preset large --seq-len 128 --batch-size 128 --compile
tail -n 30 "$OUT/err.log" 2>/dev/null
