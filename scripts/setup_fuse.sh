#!/usr/bin/env bash
# Install what the power-cut campaign (kvckpt.testing.campaigns.powerfs) needs to mount FUSE: fuse3
# (fusermount3 and libfuse3). Idempotent: does nothing when fusermount3 is already there, and
# nothing (the tests then skip, saying why) without root, apt-get or /dev/fuse.
set -euo pipefail
if command -v fusermount3 >/dev/null 2>&1; then
    exit 0
fi
if [ ! -e /dev/fuse ]; then
    echo "setup_fuse: no /dev/fuse here; the power-cut tests will skip" >&2
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_fuse: fusermount3 missing and cannot install it (needs root and apt-get); the power-cut tests will skip" >&2
    exit 0
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 libfuse3-3 >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse3 libfuse3-3 >/dev/null; }
