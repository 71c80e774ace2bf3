"""Reflinks: on a filesystem that clones (XFS with ``reflink=1``, btrfs) the checkpoint's page copy
and restore's copy share the source's blocks instead of copying them, and fall back to a copy
where the clone is refused (another filesystem: ``EXDEV``).

Each filesystem is made on a loop image of a sparse file (root, ``mkfs.xfs`` / ``mkfs.btrfs``,
``losetup`` and ``mount`` needed; the test is skipped naming exactly what is missing).
``scripts/setup_reflink.sh``, run by ``make test``, installs xfsprogs and btrfs-progs where it can.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _buffers import SCHEMA, make_group

from kvckpt import BufferConfig, ReplayBuffer, restore
from kvckpt.durability.safe_open import check_header, copy_used

FILESYSTEMS = {"xfs": ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}
IMAGE_BYTES = 320 << 20  # XFS's smallest filesystem is 300 MB; the image is sparse


def _missing(fs: str) -> str | None:
    """Why a loop-mounted ``fs`` cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (losetup and mount need it)"
    for tool in (FILESYSTEMS[fs][0], "losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed" + (" (apt-get install -y xfsprogs btrfs-progs)" if "mkfs" in tool else "")
    return None


@contextlib.contextmanager
def _loop_mount(fs: str, tmp: Path) -> Iterator[Path]:
    image, mnt = tmp / f"{fs}.img", tmp / fs
    with open(image, "wb") as f:
        f.truncate(IMAGE_BYTES)
    made = subprocess.run([*FILESYSTEMS[fs], str(image)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"{FILESYSTEMS[fs][0]} failed: {made.stderr.strip()[-300:]}")
    mnt.mkdir()
    loop = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
    if loop.returncode:
        pytest.skip(f"losetup failed: {loop.stderr.strip()[-300:]}")
    device = loop.stdout.strip()
    try:
        mounted = subprocess.run(["mount", "-t", fs, device, str(mnt)], capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"mount -t {fs} failed: {mounted.stderr.strip()[-300:]}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "--detach", device], check=True)


def _shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents the filesystem reports shared (``filefrag -v``)."""
    out = subprocess.run(["filefrag", "-v", "-b4096", str(path)], capture_output=True, text=True, check=True).stdout
    shared = 0
    for line in out.splitlines():
        cells = [c.strip() for c in line.split(":")]
        if len(cells) >= 4 and cells[0].isdigit() and "shared" in line:
            shared += int(cells[3].split()[0].rstrip(",")) * 4096 if cells[3].split() else 0
    return shared


@pytest.mark.parametrize("fs", sorted(FILESYSTEMS))
def test_checkpoint_and_restore_clone_where_the_filesystem_can(fs: str, tmp_path: Path) -> None:
    reason = _missing(fs)
    if reason:
        pytest.skip(reason)
    with _loop_mount(fs, tmp_path) as mnt:
        config = BufferConfig(group_size=2, sampler="in_order", max_buffered_rollouts=64, schema=SCHEMA)
        with ReplayBuffer.create(str(mnt / "live.kv"), config) as buf:
            for lease in buf.admit(list(range(24))):
                buf.commit_group(lease, make_group(2, lease.prompt_idx, length=4000))
            result = buf.checkpoint(str(mnt / "step.kvckpt"), {"step": 1}).wait()
        assert result.how == "clone"

        ckpt = mnt / "step.kvckpt"
        assert copy_used(str(ckpt), str(mnt / "cloned.kv"), check_header(str(ckpt))) == "clone"
        if shutil.which("filefrag"):
            assert _shared_bytes(mnt / "cloned.kv") >= os.path.getsize(ckpt) // 2
        assert (mnt / "cloned.kv").read_bytes() == ckpt.read_bytes()
        # Another filesystem cannot share the blocks (EXDEV): the copy falls back, same bytes.
        assert copy_used(str(ckpt), str(tmp_path / "copied.kv"), check_header(str(ckpt))) == "copy"
        assert (tmp_path / "copied.kv").read_bytes() == ckpt.read_bytes()

        restored, plan = restore(str(ckpt), str(mnt / "restored.kv"))
        with restored:
            assert plan.resume_version == 0
            assert len(restored.groups()) == 24
            assert restored.read_batch(restored.select(1, 2)).lengths.numel() == 4
