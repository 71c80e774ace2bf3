"""Issue 28's restore and copy figures at one size, side by side in one run:

    python -m benchmarks.restore_bench --size 1 --json restore.json   # about 10 minutes at 1 GB

1. restore to the first batch (figure 3's :func:`benchmarks.measure.restore_first_batch`: each run
   a fresh process, the file's page cache dropped): ``restore()``, ``restore(trusted=True)``, the
   crash path (``ReplayBuffer.open`` + ``recover()``) and ``torch.load`` of the same rows;
2. the CPU of each pass on the checkpoint file, cache warm: the structure pass, the metadata
   verification ``restore()`` runs, ``kvckpt verify`` (row checksums), ``kvckpt verify --deep``;
3. the copies, interleaved in rounds, each with the source's page cache dropped: the disk's
   sequential fsync'd write rate (fresh bytes, as figure 4), a plain sequential copy of the
   checkpoint file with one fsync, restore's copy (``copy_used`` + fsync), and the checkpoint of
   the live store in the background and in the foreground (stamp to renamed, fsynced file; how
   the snapshot was written is kept: ``clone``, ``copy`` or ``compact``, and the checkpoint's
   phases), with the load average.

With part 1 it also reports the floor of a restore that copies: without clones, ``restore()`` must
write the whole file durably before its first transition (``select`` commits, and LMDB's commit
fsyncs every dirty page of the file, the copy's included), so ``file bytes / the disk's
sequential fsync'd write rate`` (measured three times around the restores) bounds it, and
``torch.load``'s time over that floor is the best ratio a copying restore can reach on this disk.

Only the copies (seconds, on an existing store): ``--copies-only``.

Stores are built under ``--work`` (on the disk to measure; deleted afterwards).

Where the filesystem has reflinks (XFS with ``reflink=1``, btrfs), restore's copy and the
checkpoint's page copy are clones. To measure that on a machine whose disk has none, as root
(``bash scripts/setup_reflink.sh`` installs ``mkfs.xfs``), on a loop image whose reads bypass the
image file's own page cache (``--direct-io=on``), so dropping a file's cache on the XFS mount
really sends its next read to the disk:

    truncate -s 20G /var/tmp/xfs.img && mkfs.xfs -q -f -m reflink=1 /var/tmp/xfs.img
    dev=$(losetup --find --show --direct-io=on /var/tmp/xfs.img)
    mkdir -p /mnt/xfs && mount -t xfs "$dev" /mnt/xfs
    python -m benchmarks.restore_bench --size 1 --repeats 5 --skip-copies --work /mnt/xfs
    umount /mnt/xfs && losetup --detach "$dev" && rm /var/tmp/xfs.img

(20 GB is room for a 4 GB run: the ``torch.save`` file is about the raw size; the image is sparse.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lmdb import verify as lmdb_verify

from benchmarks import baselines, measure
from kvckpt import ReplayBuffer, check, fsync_file
from kvckpt.tooling import check_header, copy_used, is_sound, open_readonly


def _best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pass_costs(ckpt: str, repeats: int = 2) -> dict[str, float]:
    """Seconds of each check on ``ckpt`` (best of ``repeats``; deep once), page cache warm: the
    structure proof ``restore()`` runs and ``lmdb.verify`` (which decides what the proof does not
    prove), the metadata verification ``restore()`` runs (no lookups: the proof covers them) and the
    one with lookups (what the crash path and ``trusted=True`` run where their proof fails), row checksums, deep."""
    out = {"structure": _best(lambda: is_sound(ckpt), repeats),
           "structure_lmdb_verify": _best(lambda: lmdb_verify.verify(ckpt, subdir=False), repeats)}
    with open_readonly(ckpt) as store:
        for name, kwargs in (("metadata", {"lookups": False}), ("metadata_with_lookups", {}),
                             ("checksums", {"checksums": True}), ("deep", {"deep": True})):
            runs = 1 if name == "deep" else repeats
            out[name] = _best(lambda kw=kwargs: store.read(lambda txn: check(txn, **kw)), runs)
    return out


def copies(ckpt: str, live: str, out: str, repeats: int = 2) -> list[dict[str, float]]:
    """Seconds and MB/s of each copy (see the module doc), ``repeats`` rounds interleaved."""
    def plain() -> None:
        with open(ckpt, "rb") as src, open(out, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
            dst.flush()
            os.fsync(dst.fileno())

    def restore_copy() -> None:
        copy_used(ckpt, out, check_header(ckpt))
        fsync_file(out)

    rounds = []
    size = os.path.getsize(ckpt)
    for _ in range(repeats):
        result: dict[str, Any] = {"loadavg": os.getloadavg()[0],
                                  "disk_mb_s": baselines.sequential_write(out + ".disk", size)}
        for name, fn, source in (("plain", plain, ckpt), ("restore_copy", restore_copy, ckpt)):
            if os.path.exists(out):
                os.unlink(out)
            measure.evict_cache([source], "fadvise")
            result[name] = _best(fn, 1)
        with ReplayBuffer.open(live) as buf:
            for name, background in (("checkpoint_background", True), ("checkpoint_foreground", False)):
                if os.path.exists(out):
                    os.unlink(out)
                measure.evict_cache([live], "fadvise")
                t0 = time.perf_counter()
                done = buf.checkpoint(out, background=background).wait()
                result[name] = time.perf_counter() - t0
                result[f"{name}_how"] = done.how
                result[f"{name}_phases"] = {k: round(v, 4) for k, v in done.timings.items()
                                            if k in ("stamp", "find_unused", "copy", "zero_unused", "fsync_rename")}
        result.update({f"{k}_mb_s": size / result[k] / 1e6
                       for k in ("plain", "restore_copy", "checkpoint_background", "checkpoint_foreground")})
        rounds.append(result)
    os.unlink(out)
    return rounds


def main() -> None:
    """Build one size, print and optionally save the three measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GB of raw rows (default 1)")
    parser.add_argument("--skip-copies", action="store_true", help="leave out the copies (part 3)")
    parser.add_argument("--repeats", type=int, default=3, help="restore runs per mode (default 3)")
    parser.add_argument("--work", default=None, help="directory on the disk to measure (default /var/tmp)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--copies-only", action="store_true", help="measure only the copies (step 3)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvckpt-restore-", dir=args.work or "/var/tmp")
    settings = replace(measure.Settings(), restore_repeats=args.repeats)
    if args.copies_only:
        try:
            built, _ = measure.ingest(args.size, work, settings)
            ckpt = os.path.join(work, "first.kvckpt")
            built.buffer.checkpoint(ckpt, {"step": 0}).wait()
            built.buffer.close()
            rounds = copies(ckpt, built.buffer.path, os.path.join(work, "copy.out"), args.repeats)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for done in rounds:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in done.items()}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size_gb": args.size, "copies": rounds}, f, indent=1)
        return
    try:
        built, ingested = measure.ingest(args.size, work, settings)
        ckpt, pt = os.path.join(work, "first.kvckpt"), os.path.join(work, "first.pt")
        built.buffer.checkpoint(ckpt, {"step": 0}).wait()
        built.baseline.checkpoint(pt)
        live = built.buffer.path
        built.buffer.close()
        size = os.path.getsize(ckpt)
        disk = [baselines.sequential_write(os.path.join(work, "disk.probe"), size)]
        result = {"size_gb": args.size, "groups": ingested["groups"], "file_bytes": size,
                  "loadavg_start": os.getloadavg(),
                  "restore": measure.restore_first_batch(ckpt, pt, work, settings),
                  "disk_mb_s": disk + [baselines.sequential_write(os.path.join(work, "disk.probe"), size)
                                       for _ in range(2)],
                  "passes": pass_costs(ckpt),
                  "copies": [] if args.skip_copies else copies(ckpt, live, os.path.join(work, "copy.out")),
                  "loadavg_end": os.getloadavg()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    torch_s = result["restore"]["torch"]["seconds"]["p50"]
    for mode, doc in result["restore"].items():
        p50 = doc["seconds"]["p50"]
        print(f"{mode:16} {p50:8.3f} s  {torch_s / p50:5.1f}x torch.load  {doc['breakdown']}")
    rate = sorted(result["disk_mb_s"])[1]
    floor = result["file_bytes"] / 1e6 / rate
    print(f"copying floor: the {result['file_bytes'] / 1e6:.0f} MB file written durably at {rate:.0f} MB/s "
          f"(median of {[round(r) for r in result['disk_mb_s']]}) takes {floor:.3f} s: "
          f"a restore that copies reaches at most {torch_s / floor:.1f}x torch.load on this disk")
    print("passes (s):", {k: round(v, 3) for k, v in result["passes"].items()})
    for done in result["copies"]:
        print("copies:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in done.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
