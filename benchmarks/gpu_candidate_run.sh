#!/usr/bin/env bash
# The GPU run of kdax's Triton candidates (benchmarks/gpu_candidate_run.py: the plan, the
# budget and what it writes): kdax's default, the all-Triton CANDIDATE, the cost model's
# CANDIDATE_BEST and the default Triton tuning beside FLA's chunk_kda at (1,16384,16), then
# (1,4096,16) and kdax's layer beside FLA's ((4,4096,32): --second; per-kernel profiles:
# --kernels), each step a process under its own time limit; about 7 minutes, never more
# than 7 (--total 420) plus the reports. Results in $OUT/gpu (7 files).
# The one step before it, where a package registry is reachable: --prepare (below).
#
# This workplace's GPU image has no network, no beartype and no FLA. Here, once, in the
# checkout the device tool sends: `bash benchmarks/gpu_candidate_run.sh --prepare` downloads the
# wheels into .whl (ignored by git through .git/info/exclude; ~3 MB). Then carry .whl and
# run there `bash benchmarks/gpu_candidate_run.sh` (arguments go to gpu_candidate_run.py: --kernels,
# --only, --extra-pipes, --total, --fresh, --dry-run, --tests: the suite's device cases, with
# pytest from .whl). Without .whl the run stops at once
# and says so (no step can import kdax without beartype). fla-core goes
# on PYTHONPATH for every step; flash-linear-attention (fla.layers, fla.models: it
# imports transformers) only for the layer's FLA step, so the chunk_kda steps import
# FLA exactly as every earlier run did.
set -u
# pytest, hypothesis and their dependencies for --tests (the suite's device cases)
WHEELS="beartype==0.23.1 fla-core==0.6.0 flash-linear-attention==0.6.0 pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 pygments==2.20.0 packaging==26.2 hypothesis==6.155.2 sortedcontainers==2.4.0"
if [ "${1:-}" = "--prepare" ]; then
    cd "$(dirname "$0")/.." || exit 1
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
    # shellcheck disable=SC2086
    exec ${PY:-python3} -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl $WHEELS
fi
if [ ! -d .whl ] && ! ${PY:-python3} -c "import beartype" 2>/dev/null; then
    echo "no .whl folder and no beartype here: run 'bash benchmarks/gpu_candidate_run.sh --prepare' on the development" \
         "machine first and carry .whl" >&2
    exit 2
fi
OUT=${OUT:-device_out}
export OUT
PY=${PY:-python3}
nvidia-smi -L 2>/dev/null
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/beartype-*.whl .whl/fla_core-*.whl $(ls .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl \
        .whl/pygments-*.whl .whl/packaging-*.whl .whl/hypothesis-*.whl .whl/sortedcontainers-*.whl 2>/dev/null) || exit 1
    if ls .whl/flash_linear_attention-*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_layers \
            .whl/flash_linear_attention-*.whl || exit 1
        export FLA_LAYERS_PATH=/tmp/site_layers
    fi
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec $PY benchmarks/gpu_candidate_run.py "$@"
