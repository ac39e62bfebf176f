#!/usr/bin/env bash
# What a lent GPU machine lacks, packed to travel with a device call: Ray (with Train), MLflow
# and what they need, for that machine's Python 3.12, minus what its image already has (torch,
# numpy, pandas, pyarrow, scipy, scikit-learn, matplotlib, grpcio), Ray's Java jars, RLlib, its
# dashboard's web client and MLflow's web UI, with the three Ray binaries stripped of symbols:
# about 47 MB as .dev/site312.tar.xz (a call carries at most 64 MiB). On the device:
#   mkdir -p /tmp/site && tar -xJf .dev/site312.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
# Needs a Python 3.12 here (PY312) for pip's resolver.
set -eu
PY312=${PY312:-python3.12}
SITE=${SITE:-/tmp/site312}
rm -rf "$SITE"
grep -vE '^(torch|nvidia|triton)' constraints-cpu.txt >"$SITE.constraints"
"$PY312" -m pip install -q --target "$SITE" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
    -c "$SITE.constraints" "ray[default,train]" mlflow
cd "$SITE"
rm -rf pyarrow* scipy* pandas* sklearn* scikit_learn* numpy* matplotlib* fontTools* fonttools* \
    pillow* PIL* grpc grpcio* blingfire* kiwisolver* narwhals* contourpy* cycler* pyparsing* \
    joblib* threadpoolctl* virtualenv* distlib* tzdata* pytz* bin ray/jars ray/rllib ray/llm \
    ray/dashboard/client mlflow/server/js
find . -name '*.map' -delete
find . -name __pycache__ -type d -prune -exec rm -rf {} +
strip --strip-unneeded ray/_raylet.so ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
cd - >/dev/null
mkdir -p .dev
tar -cf - -C "$SITE" . | xz -T2 -6 >.dev/site312.tar.xz
ls -la .dev/site312.tar.xz
