#!/usr/bin/env bash
# Install what tests/durability/test_reflink.py needs to make XFS (reflink=1) and btrfs loop images: mkfs.xfs
# (xfsprogs) and mkfs.btrfs (btrfs-progs), about 2 MB. Idempotent: does nothing when both are
# there, and nothing (the tests then skip, saying which tool is missing) without root or apt-get.
set -euo pipefail
if command -v mkfs.xfs >/dev/null 2>&1 && command -v mkfs.btrfs >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_reflink: mkfs.xfs/mkfs.btrfs missing and cannot install them (needs root and apt-get); the reflink tests will skip" >&2
    exit 0
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -q xfsprogs btrfs-progs >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q xfsprogs btrfs-progs >/dev/null 2>&1; } \
    || echo "setup_reflink: could not install xfsprogs and btrfs-progs; the reflink tests will skip" >&2
