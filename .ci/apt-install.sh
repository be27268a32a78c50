#!/bin/sh
# Install Debian/Ubuntu packages (apt) for a group of tests, only what is missing: sh apt-install.sh WHAT PKG...
# WHAT names the tests in messages ("the multihost tests"). MASK_UNITS (optional): systemd units of
# those packages to disable and mask where systemd runs, if this run installed them.
# The packages' maintainer scripts start no service (a policy-rc.d answering 101 for the duration of the
# install, only if none exists): the tests run their own daemons inside namespaces.
# Idempotent and quiet. Never fails the build: without the packages those tests skip.
set -u
what="$1"; shift
need=""
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in "$@"; do
    have "$pkg" || need="$need $pkg"
done
[ -z "$need" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: apt-get not found; not installing$need ($what will skip)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "warning: not root and no sudo; not installing$need ($what will skip)" >&2
        exit 0
    fi
fi
echo "installing for $what:$need"
POLICY=/usr/sbin/policy-rc.d
ours=""
if [ ! -e "$POLICY" ] && printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null 2>&1; then
    $SUDO chmod 755 "$POLICY" && ours=1
fi
if ! { $SUDO apt-get update -qq >/dev/null \
       && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null; }; then
    echo "warning: could not install$need ($what will skip)" >&2
fi
[ -n "$ours" ] && $SUDO rm -f "$POLICY"
if [ -n "${MASK_UNITS:-}" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    for unit in $MASK_UNITS; do
        case " $need " in *" $unit "*)
            $SUDO systemctl disable --now "$unit" >/dev/null 2>&1
            $SUDO systemctl mask "$unit" >/dev/null 2>&1 ;;
        esac
    done
fi
exit 0
