#!/usr/bin/env bash
# Make `prometheus` and `promtool` available for tests/mpi/test_monitoring.py: Debian's package (2.42 on
# bookworm) when this machine allows it (root + apt-get), like scripts/setup_parallel_hdf5.sh. It never
# starts the package's service: the test runs its own server on a scratch directory and a port of its own.
#   scripts/install_prometheus.sh               install, or fail saying why
#   scripts/install_prometheus.sh --if-possible install, or say why not and exit 0
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_prometheus: skipped: Debian's prometheus package needs root and apt-get on this machine"
  [ "${1:-}" = "--if-possible" ] && exit 0 || exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
# policy-rc.d 101: no service may start during the install (a container has no init anyway)
policy=/usr/sbin/policy-rc.d
created=0
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created=1; fi
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends prometheus >/dev/null
[ "$created" = 1 ] && rm -f "$policy"
command -v prometheus >/dev/null && command -v promtool >/dev/null
echo "install_prometheus: $(prometheus --version 2>&1 | head -1)"
