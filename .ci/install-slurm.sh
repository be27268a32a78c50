#!/bin/sh
# What tests/multihost/test_slurm.py needs: Slurm's controller (slurmctld), node daemon (slurmd), client
# commands (sbatch, srun, squeue, scancel, sinfo, scontrol) and munge (its authentication), installed only
# when missing (see apt-install.sh). The tests run their own munged, slurmctld and slurmds inside the test
# hosts; no service the packages ship is started, and their units are masked where systemd runs.
MASK_UNITS="munge slurmctld slurmd" exec sh "$(dirname "$0")/apt-install.sh" "the Slurm tests" \
    munge slurmctld slurmd slurm-client
