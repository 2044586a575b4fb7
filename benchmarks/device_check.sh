#!/usr/bin/env bash
# One accelerator session's checks in one go (results in benchmarks/NOTES.md, "On a GPU"):
#   1. every Pallas stage compiled for the accelerator against its reference stage;
#   2. each stage alone at the standard shape, reference against Pallas (which kernels
#      compile at K=V=128, chunk 64, and how fast each one is);
#   3. the benchmark at the standard shape: the pipelines in $PIPES (default reference,
#      pallas, mixed) with the baselines, each checked against the float64 recurrence;
#   4. the all-Pallas pipeline compiled, end to end against the float64 oracle (golden
#      cases, the option grid, bf16/fp16 inputs).
# Each step has its own time limit, so one that hangs leaves the others their time.
# Logs and results go to $OUT (default ./device_out). The golden cases are read from
# ../shared/golden; where that is missing, from .devshared/golden if it was carried.
# On this workplace's GPU image (jax 0.11.2, no network, no beartype), prepare here:
#   pip download --no-deps --only-binary=:all: -d .whl beartype==0.23.1
#   mkdir -p .devshared && cp -r ../shared/golden .devshared/
# (both ignored by git), carry .whl and .devshared, and run there:
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=/tmp/site bash benchmarks/device_check.sh
set -u
OUT=${OUT:-device_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -d ../shared ] || { [ -d .devshared ] && ln -sfn "$PWD/.devshared" ../shared; }
PY=${PY:-python3}
PYTEST="$PY -m pytest -q -rfE --tb=short -p no:cacheprovider -k device"
nvidia-smi -L 2>/dev/null
$PY -c "import jax, equinox, jaxtyping, beartype; print('jax', jax.__version__, 'equinox', equinox.__version__, jax.devices())"

step() {  # step NAME SECONDS LOG COMMAND...
    local name=$1 limit=$2 log=$3 t0=$SECONDS
    shift 3
    timeout "$limit" "$@" >"$log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    tail -n 30 "$log"
}
step "Pallas stages on the device" "${STAGES_S:-150}" "$OUT/stages.log" $PYTEST tests/pallas/test_stages.py
step "stages alone" "${STAGE_BENCH_S:-120}" "$OUT/stages_bench.txt" $PY -m kdax.bench --stages --pipelines reference,pallas
step "benchmark" "${BENCH_S:-170}" "$OUT/bench.txt" $PY -m kdax.bench --pipelines "${PIPES:-reference,pallas,mixed}" --out "$OUT/bench"
step "all-Pallas pipeline on the device" "${PIPE_S:-120}" "$OUT/pipeline.log" $PYTEST tests/pallas/test_pipeline.py
