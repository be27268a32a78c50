#!/bin/sh
# Install what tests/multihost/test_slurm.py needs (Debian/Ubuntu, apt), only what is missing: Slurm's
# controller (slurmctld), node daemon (slurmd), client commands (sbatch, srun, squeue, scancel, sinfo,
# scontrol) and munge (its authentication). The tests run their own munged, slurmctld and slurmds on
# loopback and the test hosts' bridge; no service the packages ship is started or left enabled.
# Idempotent and quiet. Never fails the build: without these the Slurm tests skip.
set -u
need=""
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in munge slurmctld slurmd slurm-client; do
    have "$pkg" || need="$need $pkg"
done
[ -z "$need" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: apt-get not found; not installing$need (the Slurm tests will skip)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "warning: not root and no sudo; not installing$need (the Slurm tests will skip)" >&2
        exit 0
    fi
fi
echo "installing for the Slurm tests:$need"
# The packages' maintainer scripts would start munged, slurmctld and slurmd on every address: a
# policy-rc.d answering 101 forbids it for the duration of the install (only if none exists).
POLICY=/usr/sbin/policy-rc.d
ours=""
if [ ! -e "$POLICY" ] && printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null 2>&1; then
    $SUDO chmod 755 "$POLICY" && ours=1
fi
if ! { $SUDO apt-get update -qq >/dev/null \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null; }; then
    echo "warning: could not install$need (the Slurm tests will skip)" >&2
fi
[ -n "$ours" ] && $SUDO rm -f "$POLICY"
# Where systemd runs, keep the units of what was installed here from starting at boot (each package's
# unit is named after it; slurm-client has none); the tests start their own daemons.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    for unit in $need; do
        case "$unit" in munge|slurmctld|slurmd)
            $SUDO systemctl disable --now "$unit" >/dev/null 2>&1
            $SUDO systemctl mask "$unit" >/dev/null 2>&1 ;;
        esac
    done
fi
exit 0
