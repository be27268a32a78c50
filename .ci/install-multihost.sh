#!/bin/sh
# Install what tests/multihost needs (Debian/Ubuntu, apt), only what is missing:
# sshd and ssh for the namespace "hosts", iproute2 for `ip netns`, Open MPI for the MPI test.
# Idempotent and quiet. Never fails the build: without these the multihost tests skip.
set -u
need=""
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in openssh-server openssh-client iproute2 openmpi-bin; do
    have "$pkg" || need="$need $pkg"
done
[ -z "$need" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: apt-get not found; not installing$need (the multihost tests will skip)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "warning: not root and no sudo; not installing$need (the multihost tests will skip)" >&2
        exit 0
    fi
fi
echo "installing for the multihost tests:$need"
# Keep the packages' maintainer scripts from starting services (an sshd on 0.0.0.0:22): the tests
# run their own sshd inside namespaces. Debian's way is a policy-rc.d answering 101, here only
# for the duration of the install and only if none exists.
POLICY=/usr/sbin/policy-rc.d
ours=""
if [ ! -e "$POLICY" ] && printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null 2>&1; then
    $SUDO chmod 755 "$POLICY" && ours=1
fi
if ! { $SUDO apt-get update -qq >/dev/null \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null; }; then
    echo "warning: could not install$need (the multihost tests will skip)" >&2
fi
[ -n "$ours" ] && $SUDO rm -f "$POLICY"
exit 0
