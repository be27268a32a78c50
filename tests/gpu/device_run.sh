#!/usr/bin/env bash
# The GPU check kit's one command (issue 17, GPU): run ON a lent GPU machine, in a copy of this tree.
#
# Two commands in all:
#   1. here, with the network:   bash tests/gpu/wheels.sh      (fills .whl/, prints its size)
#   2. the device tool's call:   command "bash tests/gpu/device_run.sh", carry [".whl"], timeout_s 480
# The machine (python3 3.12, torch 2.11 with CUDA) lacks ipyparallel, ipykernel, IPython, pyzmq, ...:
# step 0 installs the carried wheels into /tmp/site (no network, no dependencies resolved). Then, each
# under its own `timeout` (SIGINT first, so a script stops its cluster; SIGKILL 10 s later), each step's
# output tee'd into its own file under $OUT; a step that fails does not stop the next:
#   0-setup.log         wheels installed, nvidia-smi -L, torch's version and GPU count
#   1-check_gpu.log     tests/gpu/check_gpu.py: nccl, DDP against a reference, fp16, --sync-bn, --compile
#   2-start.log         tests/gpu/start_check.py: %dist start timed, each rank's device and backend
#   3-transformers.log  benchmarks/transformers.py --device cuda --sizes large --cases ddp,fsdp --rounds 2
#   transformers.json   its measurements
#   summary.log         each step's exit status and seconds (also the last lines printed)
# Steps' exit status: 0 passed; 1 a check failed (transformers.py: also a ratio below its target, its JSON
# then written); 2 no GPU visible; 124 timed out.
# On the GPU the timeouts add up to 370 s (50 + 20 + 110 + 50 + 140); the lent time is 15 minutes with the
# machine's start: call it with timeout_s 480.
#
#   bash tests/gpu/device_run.sh --cpu     # here: the same steps on CPU (check_gpu.py --cpu, %dist start -n 2,
#                                          # transformers --device cpu --sizes small), no wheels installed
# PYTHON chooses the interpreter (default python3), e.g. PYTHON=/tmp/t211/bin/python for torch 2.11 here;
# OUT defaults to a new temporary folder; SIZES overrides the transformer sizes (gpu: large, cpu: small).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t distnb-gpu-out.XXXXXX)}
mkdir -p "$OUT"
DIRS=$(mktemp -d -t distnb-dirs.XXXXXX)  # ipyparallel and Jupyter write profiles and runtime files (pitfall 6)
export IPYTHONDIR=$DIRS/ipython JUPYTER_CONFIG_DIR=$DIRS/config JUPYTER_RUNTIME_DIR=$DIRS/runtime \
    JUPYTER_DATA_DIR=$DIRS/data PYTHONUNBUFFERED=1
mkdir -p "$IPYTHONDIR" "$JUPYTER_CONFIG_DIR" "$JUPYTER_RUNTIME_DIR" "$JUPYTER_DATA_DIR"
START=$(date +%s.%N)
SUMMARY="$OUT/summary.log"
: > "$SUMMARY"

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
# a command started where SIGINT is ignored (a background job) keeps it ignored, and python then never raises
# KeyboardInterrupt (FIELD-NOTES pitfall 13): reset it before exec, so timeout's SIGINT lets a script stop its cluster
UNIGNORE='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'

# step NAME SECONDS COMMAND...: run it under timeout, tee'd into $OUT/NAME.log; record status and time
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s.%N)
    echo "=== $name (timeout ${limit} s): $*" | tee -a "$OUT/$name.log"
    timeout -s INT -k 10 "$limit" "$PY" -c "$UNIGNORE" "$@" 2>&1 | tee -a "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    local took; took=$(elapsed "$t0")
    local what="exit $rc"; [ "$rc" = 124 ] && what="TIMED OUT (exit 124)"
    echo "=== $name: $what after $took s" | tee -a "$OUT/$name.log" "$SUMMARY"
}

if [ "$MODE" = gpu ]; then
    T_SETUP=50 T_CHECK=110 T_START=50 T_TF=140 SIZES=${SIZES:-large} CPUFLAG="" DEVICE=cuda
    if ls .whl/*.whl > /dev/null 2>&1; then
        step 0-setup "$T_SETUP" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl
    else
        echo "=== 0-setup: no .whl/ here: run tests/gpu/wheels.sh first and carry [\".whl\"]" | tee -a "$SUMMARY"
    fi
    export PYTHONPATH=/tmp/site:$PWD
else  # this machine's CPU, this python: nothing to install; longer limits (2 shared cores)
    T_SETUP=60 T_CHECK=300 T_START=120 T_TF=600 SIZES=${SIZES:-small} CPUFLAG=--cpu DEVICE=cpu
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

{
    echo "mode $MODE, python $PY, OUT $OUT"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    fi
    timeout 20 "$PY" -c "import sys, torch, distnb, ipyparallel, IPython; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count(), \
'ipyparallel', ipyparallel.__version__, 'IPython', IPython.__version__)"
} 2>&1 | tee -a "$OUT/0-setup.log"

step 1-check_gpu "$T_CHECK" "$PY" tests/gpu/check_gpu.py $CPUFLAG
step 2-start "$T_START" "$PY" tests/gpu/start_check.py $CPUFLAG
step 3-transformers "$T_TF" "$PY" benchmarks/transformers.py --device "$DEVICE" --sizes "$SIZES" \
    --cases ddp,fsdp --rounds 2 --epochs 1 --json "$OUT/transformers.json"
# transformers.py exits 1 also when it ran but a ratio is below its target: the JSON says it ran to the end
if [ -s "$OUT/transformers.json" ]; then
    echo "=== 3-transformers: ran to the end (transformers.json written; exit 1 = a ratio below its target)" \
        | tee -a "$SUMMARY"
fi

echo "=== all steps: $(elapsed "$START") s" >> "$SUMMARY"
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "=== summary"
cat "$SUMMARY"
