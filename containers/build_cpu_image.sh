#!/usr/bin/env bash
# Build the CPU image localhost/hpctrain:cpu with no container registry: (a) a Debian bookworm root file
# system made with debootstrap from this machine's apt mirror (cached), (b) imported as the local base image
# localhost/hpctrain-base:bookworm, (c) containers/Containerfile built on it with podman, from the hpctrain
# wheel of this checkout and its dependencies' wheels (pip download, with this machine's pip configuration).
# Idempotent: a cached root file system, an existing base image and wheels already downloaded are reused.
#
#   sudo containers/build_cpu_image.sh [--oci-archive] [--rebuild-base] [--no-check]
#
#   --oci-archive   also write containers/build/hpctrain-cpu.oci.tar (what containers/hpctrain.def builds from)
#   --rebuild-base  debootstrap again and re-import the base image
#   --no-check      skip the 2-rank `hpctrain info` in a container at the end
# Environment: HPCTRAIN_CONTAINER_CACHE (root file system cache; default ~/.cache/hpctrain/containers),
# DEBIAN_MIRROR (default: the first Debian URI of /etc/apt/sources.list{,.d}), PYTHON (builds the wheel;
# default .venv/bin/python, `make setup`), IMAGE (default localhost/hpctrain:cpu), PODMAN_ARGS (global podman
# flags, e.g. `--runtime PATH` where the default OCI runtime cannot start containers on this host).
# Needs root (debootstrap, rootful podman), debootstrap and podman (Debian: apt-get install debootstrap podman).
set -euo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
cd "$(dirname "$SELF")/.."

SUITE=bookworm
BASE_IMAGE=localhost/hpctrain-base:$SUITE
IMAGE="${IMAGE:-localhost/hpctrain:cpu}"
CACHE="${HPCTRAIN_CONTAINER_CACHE:-$HOME/.cache/hpctrain/containers}"
ROOTFS_TAR="$CACHE/debian-$SUITE-rootfs.tar"
CONTEXT=containers/build/context
ARCHIVE=containers/build/hpctrain-cpu.oci.tar
PYTHON="${PYTHON:-.venv/bin/python}"
# what the Containerfile needs from Debian, so that its build fetches nothing from apt
PACKAGES=python3,python3-venv,ca-certificates,openssh-client,openssh-server,procps

oci_archive=0 rebuild_base=0 check=1
for arg in "$@"; do
  case "$arg" in
    --oci-archive) oci_archive=1 ;;
    --rebuild-base) rebuild_base=1 ;;
    --no-check) check=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$SELF"; exit 0 ;;
    *) echo "build_cpu_image: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "build_cpu_image: $*"; }
die() { echo "build_cpu_image: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap and rootful podman need it): sudo $0 $*"
for tool in debootstrap podman; do
  command -v "$tool" > /dev/null || die "$tool is not installed (Debian: apt-get install -y $tool)"
done
[[ -x "$PYTHON" ]] || die "$PYTHON not found: run \`make setup\` first, or set PYTHON to a Python >= 3.11 with pip"

debian_mirror() {
  # the first Debian archive URI of the apt configuration (deb822 .sources or one-line sources.list)
  local uri
  uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -n 1 || true)
  [[ -n "$uri" ]] || uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' | grep -v -- '-security' | head -n 1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# (a) the root file system, cached as a tar
if [[ $rebuild_base -eq 1 ]]; then
  rm -f "$ROOTFS_TAR"
fi
if [[ -s "$ROOTFS_TAR" ]]; then
  say "(a) root file system cached: $ROOTFS_TAR"
else
  MIRROR="${DEBIAN_MIRROR:-$(debian_mirror)}"
  mkdir -p "$CACHE"
  work=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  keyring=()
  [[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] && keyring=(--keyring=/usr/share/keyrings/debian-archive-keyring.gpg)
  say "(a) debootstrap $SUITE from $MIRROR into $work (a few minutes)"
  debootstrap --variant=minbase "${keyring[@]}" --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" \
    || die "debootstrap failed (log: $work/rootfs/debootstrap/debootstrap.log); set DEBIAN_MIRROR to a reachable Debian mirror"
  # nothing machine-specific in the image: no apt lists, no ssh host keys (the MPI Operator mounts its own)
  rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/etc/ssh/ssh_host_"*
  tar --numeric-owner --xattrs -C "$work/rootfs" -cf "$work/rootfs.tar" .
  mv "$work/rootfs.tar" "$ROOTFS_TAR"  # the cache holds only complete root file systems
  rm -rf "$work"
  trap - EXIT
  say "(a) cached $ROOTFS_TAR ($(du -h "$ROOTFS_TAR" | cut -f1))"
fi

# (b) the local base image
if [[ $rebuild_base -eq 0 ]] && podman ${PODMAN_ARGS:-} image exists "$BASE_IMAGE"; then
  say "(b) base image present: $BASE_IMAGE"
else
  podman ${PODMAN_ARGS:-} image exists "$BASE_IMAGE" && podman ${PODMAN_ARGS:-} rmi -f "$BASE_IMAGE" > /dev/null
  say "(b) podman import $ROOTFS_TAR as $BASE_IMAGE"
  podman ${PODMAN_ARGS:-} import --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$ROOTFS_TAR" "$BASE_IMAGE" > /dev/null
fi

# (c) the wheels, then the image
mkdir -p "$CONTEXT/wheels"
rm -f "$CONTEXT"/wheels/hpctrain-*.whl  # exactly one hpctrain wheel: this checkout's
say "(c) building the hpctrain wheel from $(pwd)"
"$PYTHON" -m pip wheel --no-deps --no-build-isolation --quiet . -w "$CONTEXT/wheels"
wheel=$(ls "$CONTEXT"/wheels/hpctrain-*.whl)
say "(c) dependency wheels into $CONTEXT/wheels (pip download; already downloaded ones are kept)"
"$PYTHON" -m pip download --quiet --only-binary=:all: -c scripts/constraints.txt -d "$CONTEXT/wheels" "$wheel[mpi,monitor]" \
  || die "pip download failed: this machine's pip must reach an index holding torch $(grep -o '==.*' scripts/constraints.txt) (CPU) and the other dependencies"
say "(c) podman build -f containers/Containerfile -t $IMAGE (base $BASE_IMAGE, no registry)"
podman ${PODMAN_ARGS:-} build --pull=never --build-arg BASE_IMAGE="$BASE_IMAGE" -f containers/Containerfile -t "$IMAGE" "$CONTEXT"
say "(c) built $IMAGE: $(podman ${PODMAN_ARGS:-} image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MiB", $1 / 1048576}')"

if [[ $oci_archive -eq 1 ]]; then
  rm -f "$ARCHIVE"
  podman ${PODMAN_ARGS:-} save --format oci-archive -o "$ARCHIVE" "$IMAGE"
  say "wrote $ARCHIVE (apptainer build hpctrain.sif containers/hpctrain.def)"
fi

if [[ $check -eq 1 ]]; then
  say "check: mpiexec -n 2 hpctrain info inside $IMAGE"
  podman ${PODMAN_ARGS:-} run --rm --shm-size=1g "$IMAGE" mpiexec -n 2 hpctrain info \
    || die "the image was built but 2 ranks did not start in it (see above)"
fi
say "done: podman run --rm --shm-size=1g -v \"\$PWD/runs:/runs\" $IMAGE mpiexec -n 2 hpctrain train train.steps=10 (docs/containers.md)"
