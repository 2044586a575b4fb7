#!/usr/bin/env bash
# Issue 26's GPU run (benchmarks/gpu_issue26.py: the plan, the budget and what it writes):
# kdax beside FLA's chunk_kda at (1,16384,16), (1,4096,16), (4,4096,32) and kdax's layer
# beside FLA's, each step a process under its own time limit; about 6 minutes, never
# more than 6.5 (--total 390) plus the reports. Results in $OUT/gpu (7 files).
#
# This workplace's GPU image has no network, no beartype and no FLA. Prepare here, once
# (the folder is ignored by git; ~2 MB):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       beartype==0.23.1 fla-core==0.6.0 flash-linear-attention==0.6.0
# then carry .whl and run there `bash benchmarks/gpu_issue26.sh` (arguments go to
# gpu_issue26.py: --only, --extra-pipes, --total, --fresh, --dry-run). fla-core goes
# on PYTHONPATH for every step; flash-linear-attention (fla.layers, fla.models: it
# imports transformers) only for the layer's FLA step, so the chunk_kda steps import
# FLA exactly as every earlier run did.
set -u
OUT=${OUT:-device_out}
export OUT
PY=${PY:-python3}
nvidia-smi -L 2>/dev/null
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/beartype-*.whl .whl/fla_core-*.whl || exit 1
    if ls .whl/flash_linear_attention-*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_layers \
            .whl/flash_linear_attention-*.whl || exit 1
        export FLA_LAYERS_PATH=/tmp/site_layers
    fi
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec $PY benchmarks/gpu_issue26.py "$@"
