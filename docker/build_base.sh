#!/usr/bin/env bash
# The CPU image's base where no image registry is reachable: Debian bookworm from Debian's own package
# mirror (debootstrap), imported as a local image. Built once per machine: an existing tag is reused.
#   docker/build_base.sh [TAG]          # default dsharness-base:bookworm
# Needs root, debootstrap and a running Docker daemon. About 2 min and 120 MB.
set -euo pipefail
TAG=${1:-dsharness-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "[base] $TAG exists: reused"
  exit 0
fi
ROOTFS=$(mktemp -d /tmp/dsharness-base.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
start=$SECONDS
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
  || { tail -20 "$ROOTFS.log" >&2; echo "[base] debootstrap failed (log: $ROOTFS.log)" >&2; exit 1; }
rm -f "$ROOTFS.log"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import -c 'CMD ["bash"]' - "$TAG" >/dev/null
echo "[base] $TAG built in $((SECONDS - start)) s"
