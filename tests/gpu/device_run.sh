#!/usr/bin/env bash
# The GPU check kit's one command, for a machine with ONE GPU (issue 39; the GPU review's checks).
#
# Two commands in all:
#   1. here, with the network:   bash tests/gpu/wheels.sh      (fills .whl/, prints its size)
#   2. the device tool's call:   command "bash tests/gpu/device_run.sh", carry [".whl"], timeout_s 480
# The machine (python3 3.12, torch with CUDA) lacks ipyparallel, ipykernel, IPython, pyzmq, ...: step 0
# installs the carried wheels into /tmp/site (no network, no dependencies resolved). Then, each under its
# own `timeout` (SIGINT first, so a script stops its cluster; SIGKILL 10 s later), each step's output tee'd
# into its own file under $OUT; a step that fails does not stop the next:
#   0-setup.log      wheels installed; GPU discovery side by side (finding 13): /proc/driver/nvidia/gpus,
#                    nvidia-smi -L, distnb's visible_gpus(), torch.cuda.device_count() in a subprocess
#                    (CUDA_VISIBLE_DEVICES=0 exported when nvidia-smi sees a GPU that visible_gpus() misses)
#   1-gpu1.log       tests/gpu/check_gpu.py: a world of ONE nccl rank (NCCL needs a GPU per rank): CPU tensors
#                    on the group, failure/re-form cycles with the GPU memory after each, --nan stop, every
#                    strategy with bf16/fp16, the per-cell peak, checkpoints, the data path's syncs, %dist where
#                    and an interrupt in a long kernel, --offload cpu under a memory cap, no CUDA outside
#   2-gpu2.log       tests/gpu/check_two_ranks.py: two ranks on the one GPU over gloo (CUDA_VISIBLE_DEVICES=0,0
#                    --backend gloo): parity, fsdp, scale 1 -> 2, a rank failing, --compile's workers
#   checks.json      every check's figures, {"gpu1.<check>": {...}, "gpu2.<check>": {...}} (each check wrote
#                    $OUT/checks/<name>.json; merged here: the device call brings back 8 files at most)
#   summary.log      each step's exit status and seconds
# Exit status of a step: 0 every check passed (or was skipped, saying why); 1 a check failed (its JSON
# says which and why); 2 no GPU visible; 124 timed out.
# On the GPU the limits add up to 440 s (40 + 250 + 150), in about 200 s of checks when they pass: call
# it with timeout_s 480 (the lent time is 15 minutes with the machine's start).
#
#   bash tests/gpu/device_run.sh --cpu     # here: the same scripts with --cpu (one and two CPU ranks, gloo)
# PYTHON chooses the interpreter (default python3); OUT defaults to a new temporary folder.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu
[ "${1:-}" = "--cpu" ] && MODE=cpu
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t distnb-gpu-out.XXXXXX)}
export OUT CHECKS_DIR="$OUT/checks"
mkdir -p "$OUT" "$CHECKS_DIR"
DIRS=$(mktemp -d -t distnb-dirs.XXXXXX)  # ipyparallel and Jupyter write profiles and runtime files (pitfall 6)
export IPYTHONDIR=$DIRS/ipython JUPYTER_CONFIG_DIR=$DIRS/config JUPYTER_RUNTIME_DIR=$DIRS/runtime \
    JUPYTER_DATA_DIR=$DIRS/data PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
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
    T_SETUP=40 T_ONE=250 T_TWO=150 CPUFLAG=""
    if ls .whl/*.whl > /dev/null 2>&1; then
        step 0-setup "$T_SETUP" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl
    else
        echo "=== 0-setup: no .whl/ here: run tests/gpu/wheels.sh first and carry [\".whl\"]" | tee -a "$SUMMARY"
    fi
    export PYTHONPATH=/tmp/site:$PWD
else  # this machine's CPU, this python: nothing to install; longer limits (2 shared cores)
    T_SETUP=60 T_ONE=900 T_TWO=600 CPUFLAG=--cpu
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

{
    echo "mode $MODE, python $PY, OUT $OUT, cores $(nproc)"
    echo "/proc/driver/nvidia/gpus: $(ls /proc/driver/nvidia/gpus 2>&1 | tr '\n' ' ')"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_mode --format=csv,noheader
    else
        echo "nvidia-smi: not found"
    fi
    timeout 60 "$PY" -c "import sys, torch, distnb, ipyparallel, IPython; from distnb.core.net import visible_gpus; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'ipyparallel', ipyparallel.__version__, 'IPython', IPython.__version__); print('visible_gpus()', visible_gpus()); \
print('torch.cuda.device_count()', torch.cuda.device_count())"
    timeout 30 "$PY" -c "from distnb.core import gpus; print('distnb.core.gpus.discover()', gpus.discover())" 2>&1 | tail -1
    df -h /dev/shm | tail -1 | awk '{print "/dev/shm: " $2 " total, " $4 " free"}'
} 2>&1 | tee -a "$OUT/0-setup.log"
if [ "$MODE" = gpu ] && command -v nvidia-smi > /dev/null && nvidia-smi -L | grep -q '^GPU' \
        && [ "$("$PY" -c 'from distnb.core.net import visible_gpus; print(len(visible_gpus()))' 2>/dev/null)" = 0 ]; then
    echo "visible_gpus() finds none but nvidia-smi does (finding 13): CUDA_VISIBLE_DEVICES=0" | tee -a "$OUT/0-setup.log"
    export CUDA_VISIBLE_DEVICES=0
fi

step 1-gpu1 "$T_ONE" "$PY" tests/gpu/check_gpu.py $CPUFLAG
step 2-gpu2 "$T_TWO" "$PY" tests/gpu/check_two_ranks.py $CPUFLAG

"$PY" - "$CHECKS_DIR" "$OUT/checks.json" <<'PY'
import json, os, sys
folder, target = sys.argv[1:]
merged = {}
for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name)) as f:
        merged[name[:-len(".json")]] = json.load(f)
with open(target, "w") as f:
    json.dump(merged, f, indent=1)
ok = sum(v.get("ok") is True for v in merged.values())
bad = [k for k, v in merged.items() if v.get("ok") is False]
skipped = [k for k, v in merged.items() if v.get("ok") is None]
print(f"checks.json: {len(merged)} checks, {ok} passed, {len(bad)} failed {bad or ''}, skipped {skipped or 'none'}")
PY
rm -rf "$CHECKS_DIR"
echo "=== all steps: $(elapsed "$START") s" >> "$SUMMARY"
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "=== summary"
cat "$SUMMARY"
