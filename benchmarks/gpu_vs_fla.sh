#!/usr/bin/env bash
# kdax beside FLA on one GPU, each step under its own time limit so that one that hangs
# leaves the others their time: (1) kdax's pipelines and the float64 reference
# (gpu_vs_fla.py, JAX), which saves the inputs and the reference; (2) FLA on the same
# inputs (fla_side.py, PyTorch only: FLA's first call in a process that also held JAX did
# not return within 200 s on the first H100 run); (3) the table and plot of both.
# Results go to $OUT/gpu (default ./device_out/gpu), logs to $OUT. On this workplace's
# GPU image (no network; no FLA, no beartype), prepare here (folders ignored by git):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl beartype==0.23.1 fla-core==0.6.0
# carry .whl, and run there:
#   pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     PYTHONPATH=/tmp/site bash benchmarks/gpu_vs_fla.sh
set -u
OUT=${OUT:-device_out}
mkdir -p "$OUT/gpu"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
SHAPE=${SHAPE:-1x16384x16}
nvidia-smi -L 2>/dev/null

step() {  # step NAME SECONDS LOG COMMAND...
    local name=$1 limit=$2 log=$3 t0=$SECONDS
    shift 3
    timeout "$limit" "$@" >"$log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    grep -v "Warning\|warn(\|^\s*$" "$log" | tail -n 12
}
step "kdax at $SHAPE" "${KDAX_S:-170}" "$OUT/kdax.log" \
    $PY benchmarks/gpu_vs_fla.py --shapes "$SHAPE" --pipes "${PIPES:-reference,pallas,reference_highest}" \
    --no-fla --reps "${REPS:-20}" --budget "${BUDGET_S:-125}" --save-ref "/tmp/ref_{shape}.npz" --out "$OUT/gpu"
step "FLA at $SHAPE" "${FLA_S:-130}" "$OUT/fla.log" env TRITON_PRINT_AUTOTUNING=1 \
    $PY benchmarks/fla_side.py --ref "/tmp/ref_$SHAPE.npz" --out "$OUT/gpu" --reps "${REPS:-20}" \
    --max-configs "${FLA_CONFIGS:-4}"
step "report" 40 "$OUT/report.log" $PY benchmarks/gpu_vs_fla.py --shapes "" --no-fla --out "$OUT/gpu"
cat "$OUT/gpu/results.txt"
