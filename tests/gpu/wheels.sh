#!/usr/bin/env bash
# Fetch, on a machine with the network, the wheels tests/gpu/device_run.sh installs on the GPU machine
# (issue 17, GPU): ipyparallel, ipykernel, ipython, ipywidgets and setproctitle with their dependencies,
# for CPython 3.12 on manylinux x86-64, into .whl/ (git-ignored), less what the device image already has.
#
#     bash tests/gpu/wheels.sh        # here, before the device call; prints the kit's size
#
# Then the device tool's one call: command "bash tests/gpu/device_run.sh", carry [".whl"]
# (.whl/ is ignored by git, so it travels only when carried; 64 MiB at most).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
rm -rf .whl
$PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl ipyparallel ipykernel ipython ipywidgets setproctitle
echo "downloaded: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
# the device image has these already (torch 2.11's image): drop them, so only what is missing travels
have="numpy psutil cloudpickle packaging pygments python_dateutil tqdm typing_extensions six tzdata"
for name in $have; do
    rm -f .whl/"$name"-*.whl .whl/"$(echo "$name" | tr '[:upper:]' '[:lower:]')"-*.whl
done
# one version of each project (pip download can leave two when dependencies ask differently): keep the newest
$PY - <<'PY'
import os, re
from packaging.version import Version
best = {}
for f in sorted(os.listdir(".whl")):
    name, ver = f.split("-")[:2]
    key = re.sub(r"[-_.]+", "_", name).lower()
    if key in best and Version(best[key][0]) >= Version(ver):
        os.remove(os.path.join(".whl", f))
        continue
    if key in best:
        os.remove(os.path.join(".whl", best[key][1]))
    best[key] = (ver, f)
PY
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "kit: $(ls .whl | wc -l) wheels, $((total / 1024)) KiB in .whl/ (carry limit 64 MiB):"
ls .whl
