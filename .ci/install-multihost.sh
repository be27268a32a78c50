#!/bin/sh
# What tests/multihost needs: sshd and ssh for the namespace "hosts", iproute2 for `ip netns`, Open MPI
# for the MPI test (installed only when missing; see apt-install.sh).
exec sh "$(dirname "$0")/apt-install.sh" "the multihost tests" openssh-server openssh-client iproute2 openmpi-bin
