"""One function per benchmark figure: measured results (:mod:`benchmarks.measure`) -> a table.

Every table puts kvckpt next to its baseline and states the ratio; :func:`targets` checks the
issue's targets against the same numbers. Times in the tables are milliseconds unless a column
says seconds; "raw" is the padded tensors' bytes (see :mod:`benchmarks.data`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MB = 1e6
GB = 1e9


@dataclass
class Table:
    """A titled Markdown table with notes under it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        """The table as GitHub Markdown (title as a heading, notes as a paragraph)."""
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(self.columns))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", " ".join(self.notes)]
        return "\n".join(lines) + "\n"


def ms(seconds: float) -> str:
    """Seconds as milliseconds, 3 significant digits at most."""
    value = seconds * 1e3
    return f"{value:.3g}" if value < 100 else f"{value:,.0f}"


def secs(seconds: float) -> str:
    """Seconds with 3 significant digits."""
    return f"{seconds:.3g}"


def ratio(value: float) -> str:
    """A ratio such as ``12.5×``."""
    return f"{value:,.3g}×" if value < 1000 else f"{value:,.0f}×"


def _size(result: dict[str, Any]) -> str:
    return f"{result['size_gb']:g}"


def _pair(stats: dict[str, float]) -> str:
    return f"{ms(stats['p50'])} / {ms(stats['p99'])}"


def _trio(stats: dict[str, float]) -> str:
    return f"{ms(stats['p50'])} / {ms(stats['p99'])} / {ms(stats['max'])}"


def fig1_commit_latency(results: dict[str, Any]) -> Table:
    """Producer commit latency p50/p99/max with and without a checkpoint running."""
    table = Table("Figure 1: producer commit latency while a checkpoint runs (ms, p50 / p99 / max)",
                  ["buffer (GB raw)", "system", "no checkpoint", "checkpoint running", "p99 ratio (running / none)",
                   "max stall", "commits (none / running)", "warm-up max"])
    for result in results["sizes"]:
        load = result["load"]
        for system, name in (("kvckpt", "kvckpt"), ("baseline", "torch.save under a lock")):
            idle, busy = load[system]["idle"]["commit"], load[system]["ckpt"]["commit"]
            warm = load[system]["warmup"]["commit"]
            table.rows.append([_size(result), name, _trio(idle), _trio(busy), ratio(busy["p99"] / idle["p99"]),
                               ms(busy["max"]), f"{idle['n']} / {busy['n']}", ms(warm["max"])])
    table.notes.append(
        "A producer offers groups at a fixed rate (column `rate` in the JSON; the lower of the configured rate and "
        "a quarter of the measured single-producer ingest rate) while a trainer consumes as many in steps; "
        "latency runs from the commit's scheduled time to its return, so waiting behind a stall counts. "
        "\"Checkpoint running\" are commits overlapping a checkpoint, with checkpoints back to back for the phase. "
        "kvckpt's commit is durable (fsync); the baseline's is a dict insert (not durable). Each system first "
        f"runs the load for {results['settings']['warmup_seconds']:g} s unmeasured (\"warm-up max\"): right after "
        "a large ingest the first seconds show one-off commit outliers, checkpoint or not. \"No checkpoint\" "
        "pools two phases, one before and one after the checkpoint phase. kvckpt's page copy (in-kernel, paced "
        "write-back) runs at normal CPU priority beside them; the machine has 2 cores, so producer, trainer and "
        "copy share them.")
    return table


def fig2_trainer_blocked(results: dict[str, Any]) -> Table:
    """Trainer-blocked time per checkpoint: kvckpt's stamp vs the stop-the-world copy."""
    table = Table("Figure 2: trainer-blocked time per checkpoint (ms)",
                  ["buffer (GB raw)", "kvckpt stamp, under load (p50 / max)", "kvckpt stamp, idle",
                   "bare durable LMDB txn (p50 / p99)", "baseline stop-the-world (p50 / max)", "baseline, idle",
                   "baseline / kvckpt (p50)", "kvckpt background copy (s)",
                   "copy MB/s (share of the disk's fsync'd sequential write)",
                   "trainer step p99 while checkpointing: kvckpt / baseline"])
    for result in results["sizes"]:
        load, idle = result["load"], result["checkpoint_no_load"]
        kv = [c["blocked"] for c in load["kvckpt"]["ckpt"]["checkpoints"]]
        base = [c["blocked"] for c in load["baseline"]["ckpt"]["checkpoints"]]
        copy = [c["total"] - c["blocked"] for c in load["kvckpt"]["ckpt"]["checkpoints"]]
        ours = load["kvckpt"]["ckpt"]["checkpoints"]
        rate = _median([c["file_bytes"] / (c["total"] - c["blocked"]) / MB for c in ours])
        disk = result["ingest"]["disk_seq_write_MBps"]
        table.rows.append([
            _size(result), f"{ms(_median(kv))} / {ms(max(kv))}", ms(idle["kvckpt"]["blocked"]),
            _pair(result["ingest"]["bare_small_txn"]),
            f"{ms(_median(base))} / {ms(max(base))}", ms(idle["baseline"]["blocked"]),
            ratio(_median(base) / _median(kv)), secs(_median(copy)), f"{rate:,.0f} ({rate / disk:.0%})",
            f"{ms(load['kvckpt']['ckpt']['trainer_step']['p99'])} / "
            f"{ms(load['baseline']['ckpt']['trainer_step']['p99'])}"])
    table.notes.append(
        "kvckpt: the time `buffer.checkpoint()` takes to return (the stamp transaction, including any wait for a "
        "producer's commit in progress); the page copy then runs in the background (copy MB/s: file bytes over the "
        "time from the stamp to the renamed, fsynced file, median). The bare durable LMDB "
        "transaction (one 300-byte put, default flags, same disk) is the floor under any stamp. Baseline: the time "
        "`torch.save` holds the buffer's lock (its fsync and rename happen after the lock is released). "
        "\"Idle\" is one checkpoint right after ingest, without load.")
    return table


def fig3_restore(results: dict[str, Any]) -> Table:
    """Time from restore start to the first training batch, fresh process, cold page cache."""
    table = Table("Figure 3: restore start -> first training batch, fresh process (seconds, median)",
                  ["buffer (GB raw)", "kvckpt restore()", "kvckpt restore(trusted=True)", "kvckpt live-store recover()",
                   "torch.load", "torch.load / kvckpt (default / trusted / live)", "torch.load mmap=True",
                   "mmap / kvckpt (default / trusted / live)", "kvckpt default: copy / structure / recover (of which "
                   "verify) / fsync wait / rename + open / select + read_batch", "kvckpt trusted: same"])
    for result in results["sizes"]:
        r = result["restore"]
        kv, tr, pt, mm = (r[m]["seconds"]["p50"] for m in ("kvckpt", "kvckpt_trusted", "torch", "torch_mmap"))
        lv = r["kvckpt_live"]["seconds"]["p50"] if "kvckpt_live" in r else float("nan")
        table.rows.append([_size(result), secs(kv), secs(tr), secs(lv), secs(pt),
                           f"{ratio(pt / kv)} / {ratio(pt / tr)} / {ratio(pt / lv)}", secs(mm),
                           f"{ratio(mm / kv)} / {ratio(mm / tr)} / {ratio(mm / lv)}",
                           _restore_breakdown(r["kvckpt"]), _restore_breakdown(r["kvckpt_trusted"])])
    table.notes.append(
        f"Page cache of the checkpoint file dropped before each run ({results['settings']['cold']}); "
        "imports happen before the clock starts. kvckpt: `restore()` copies the file next to the live path, "
        "fsyncs the copy on a background thread while it checks the copy (by default a pure-Python structure "
        "check, then every invariant and every row's checksum inside the recovery transaction; `trusted=True` "
        "skips the structure check and the row checksums), renames it to the live path and opens it; then "
        "`select()` + `read_batch()` of one step (which decode and check every row they return). "
        "Live-store `recover()` is the crash path, no file copied: `ReplayBuffer.open` of the live store the "
        "trainer left (here: the same state), `recover()` (every invariant, row keys only), `select()` + "
        "`read_batch()`. "
        "Baseline: `torch.load` (`weights_only=True`) of the same rows as padded "
        "tensors + the same-shaped batch.")
    return table


def _restore_breakdown(run: dict[str, Any]) -> str:
    b = run["breakdown"]
    return (f"{secs(b['copy'])} / {secs(b['structure'])} / {secs(b['recover'])} ({secs(b['validate'])}) / "
            f"{secs(b['fsync_wait'])} / {secs(b['rename'] + b['open'])} / {secs(run['seconds']['p50'] - b['restore'])}")


def fig4_ingest(results: dict[str, Any]) -> Table:
    """Durable ingest throughput vs a bare LMDB put loop of the same bytes, and the disk."""
    table = Table("Figure 4: durable ingest throughput (MB/s of raw rows, groups/s in brackets)",
                  ["buffer (GB raw)", "kvckpt, 1 producer", "kvckpt, N producers", "bare LMDB put loop",
                   "bare LMDB encode + put", "1 producer / bare", "N producers / bare",
                   "1 producer / (encode + put)", "disk fsync'd sequential write (MB/s)"])
    for result in results["sizes"]:
        ing = result["ingest"]
        raw, n = ing["raw_bytes"], ing["groups"]

        def rate(seconds: float, raw: int = raw, n: int = n) -> str:
            return f"{raw / MB / seconds:,.0f} ({n / seconds:,.0f})"

        kv, thr, bare = ing["kvckpt_seconds"], ing["threads_seconds"], ing["bare_seconds"]
        both = ing["encode_seconds"] + bare
        table.rows.append([_size(result), rate(kv), f"{rate(thr)} [{ing['threads']}]", rate(bare), rate(both),
                           ratio(bare / kv), ratio(bare / thr), ratio(both / kv),
                           f"{ing['disk_seq_write_MBps']:,.0f}"])
    table.notes.append(
        "kvckpt: `admit` (32 prompts per transaction) + `commit_group` per group (validate, encode, one durable "
        "transaction). Bare LMDB: the same encoded values under the same keys, one transaction per group, "
        "py-lmdb's default durable flags; \"encode + put\" adds the same codec call, timed apart. The kvckpt and "
        "bare loops alternate every 32 groups, so they share the machine's noise. N producers: threads "
        "committing to a second store (encoding runs in parallel, transactions are serialised).")
    return table


def fig4b_commit_breakdown(results: dict[str, Any]) -> Table:
    """Where a kvckpt commit's time goes, next to the bare loop's transaction (wall and CPU)."""
    table = Table("Figure 4b: per-group commit cost (ms): kvckpt vs the bare LMDB transaction",
                  ["buffer (GB raw)", "kvckpt commit_group wall p50 / p99", "bare LMDB txn wall p50 / p99",
                   "CPU per group: kvckpt (admit + commit)", "CPU: encode alone", "CPU: kvckpt minus encode",
                   "CPU: bare txn", "4 KiB write + fsync p50 / p99"])
    for result in results["sizes"]:
        ing = result["ingest"]
        n = ing["groups"]
        kv, enc, bare = ing["kvckpt_cpu"] / n, ing["encode_cpu"] / n, ing["bare_cpu"] / n
        table.rows.append([_size(result), _pair(ing["kvckpt_commit"]), _pair(ing["bare_commit"]),
                           ms(kv), ms(enc), ms(kv - enc), ms(bare), _pair(ing["disk_fsync_4k"])])
    table.notes.append(
        "CPU is the measuring thread's CPU time (no fsync waits), the least noisy measure on a shared machine. "
        "\"Encode alone\" is the same `schema.validate` + `codec.encode` calls kvckpt makes, run apart for the "
        "bare loop; \"kvckpt minus encode\" is then the store's own work per group (ledger, group record, "
        "indexes, state, digests, the LMDB puts) next to the bare loop's puts.")
    return table


def fig5_bytes(results: dict[str, Any]) -> Table:
    """Bytes on disk per raw byte, for kvckpt's live file and checkpoint and the baselines."""
    table = Table("Figure 5: bytes on disk per raw byte",
                  ["buffer (GB raw)", "raw GB (unpadded share)", "kvckpt live file", "kvckpt checkpoint file",
                   "kvckpt checkpoint / unpadded bytes", "torch.save file", "bare LMDB file",
                   "torch.save / kvckpt checkpoint"])
    for result in results["sizes"]:
        ing, idle = result["ingest"], result["checkpoint_no_load"]
        raw = ing["raw_bytes"]
        ckpt, pt = idle["kvckpt"]["file_bytes"], idle["baseline"]["file_bytes"]
        table.rows.append([_size(result), f"{raw / GB:.2f} ({ing['unpadded_bytes'] / raw:.0%})",
                           f"{ing['kvckpt_file_bytes'] / raw:.3f}", f"{ckpt / raw:.3f}",
                           f"{ckpt / ing['unpadded_bytes']:.3f}", f"{pt / raw:.3f}",
                           f"{ing['bare_file_bytes'] / raw:.3f}", ratio(pt / ckpt)])
    table.notes.append("Files measured right after ingest (no load): the live store, one checkpoint of it, and "
                       "`torch.save` of the in-memory baseline holding the same groups.")
    return table


def fig6_select(results: dict[str, Any]) -> Table:
    """Select latency against the number of buffered groups, per sampler."""
    sel = results["select"]
    counts = list(next(iter(next(iter(sel["latency"].values())).values())))
    table = Table("Figure 6: select latency vs buffered groups (ms)",
                  ["sampler", "filesystem, measure", *[f"{int(c):,} groups" for c in counts],
                   "largest p50 / smallest p50"])
    for place, samplers in sel["latency"].items():
        for name, by_count in samplers.items():
            if place == "disk":
                cells = [f"{ms(by_count[c]['p50'])} / {ms(by_count[c]['p99'])}" for c in counts]
                p50s = [by_count[c]["p50"] for c in counts]
                label = "disk, wall p50 / p99"
            else:
                cells = [f"{ms(by_count[c]['cpu']['p50'])} / {ms(by_count[c]['p50'])}" for c in counts]
                p50s = [by_count[c]["cpu"]["p50"] for c in counts]
                label = "tmpfs, CPU p50 / wall p50"
            table.rows.append([name, label, *cells, ratio(max(p50s) / min(p50s))])
    builds = ", ".join(f"{int(c):,}: {s['build_seconds']:.0f} s" for c, s in sel["stores"].items())
    table.notes.append(
        "Each select claims up to 8 groups in one durable transaction; `finish_step` between selects (untimed); "
        "for one sampler all sizes are open at once and measured round-robin. Groups hold 2 rows of 16 tokens "
        "over 8 weight versions. \"disk\": the work directory's disk, fsync included, wall time. \"tmpfs\": "
        "the CPU cost alone (this thread's CPU time; the ratio column uses it), where an O(buffer) scan would "
        f"show. Building the stores through the real API ({sel['build_on']}, one transaction per commit) took "
        f"{builds}.")
    return table


def fig7_work_lost(results: dict[str, Any]) -> Table:
    """Committed groups (and generated tokens) lost per crash, by recovery mode."""
    table = Table("Figure 7: generation work lost per crash (groups / generated tokens)",
                  ["crash point", "acked groups", "live-store recovery", "checkpoint-only recovery",
                   "redispatched (live / checkpoint)", "next select (live / checkpoint)"])
    for point, r in results["crashes"].items():
        live, ckpt = r["live"], r["checkpoint"]
        table.rows.append([point, str(r["acked"]), f"{live['lost_groups']} / {live['lost_tokens']:,}",
                           f"{ckpt['lost_groups']} / {ckpt['lost_tokens']:,}",
                           f"{live['redispatch']} / {ckpt['redispatch']}", f"{live['selected']} / {ckpt['selected']}"])
    s = results["settings"]
    table.notes.append(
        f"A GRPO loop ({s['crash_groups_per_step']} groups per step, producers one step ahead, a checkpoint every "
        f"{s['crash_steps_per_checkpoint']} steps) SIGKILLs itself at the crash point; a fresh process then "
        "recovers the live store to the last checkpoint's version, and restores that checkpoint file to another "
        "path. Lost = acknowledged commits that are not a committed group after recovery (they must be "
        "generated again). Checkpoint-only recovery is what torch.save-style peers offer.")
    return table


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def number(figure: Any) -> str:
    """The figure number of a table function (``fig4b_commit_breakdown`` -> ``"4"``)."""
    return figure.__name__[3]


def targets(results: dict[str, Any], only: set[str] | None = None) -> Table:
    """The issue's targets, checked against the measured numbers (only figures in ``only``)."""
    table = Table("Targets", ["figure", "target", "measured", "met"])

    def add(fig: str, target: str, measured: str, met: bool) -> None:
        if only is None or fig in only:
            table.rows.append([fig, target, measured, "yes" if met else "**no**"])

    sizes = results["sizes"]
    p99 = [r["load"]["kvckpt"]["ckpt"]["commit"]["p99"] / r["load"]["kvckpt"]["idle"]["commit"]["p99"] for r in sizes]
    add("1", "kvckpt commit p99 with a checkpoint running within 2× of none, every size",
        ", ".join(ratio(v) for v in p99), all(v <= 2 for v in p99))
    blocked = [[c["blocked"] for c in r["load"]["kvckpt"]["ckpt"]["checkpoints"]] for r in sizes]
    add("2", "trainer blocked per checkpoint under 20 ms, max under load (p50 in brackets)",
        ", ".join(f"{ms(max(v))} ({ms(_median(v))}) ms" for v in blocked), all(max(v) < 0.020 for v in blocked))
    big = [r for r in sizes if r["size_gb"] >= 1] or sizes[-1:]
    for mode, label in (("kvckpt", "restore()"), ("kvckpt_trusted", "restore(trusted=True)"),
                        ("kvckpt_live", "after a crash, live-store recover()")):
        if any(mode not in r["restore"] for r in big):
            continue
        speed = [r["restore"]["torch"]["seconds"]["p50"] / r["restore"][mode]["seconds"]["p50"] for r in big]
        add("3", f"{label} to first batch >= 10× faster than torch.load at 1 GB and up",
            ", ".join(ratio(v) for v in speed), all(v >= 10 for v in speed))
    thr = [r["ingest"]["bare_seconds"] / r["ingest"]["kvckpt_seconds"] for r in sizes]
    add("4", "durable ingest >= 80% of the bare LMDB loop (1 producer)", ", ".join(f"{v:.0%}" for v in thr),
        all(v >= 0.8 for v in thr))
    size = [r["checkpoint_no_load"]["kvckpt"]["file_bytes"] / r["ingest"]["raw_bytes"] for r in sizes]
    add("5", "checkpoint bytes per raw byte <= 0.15", ", ".join(f"{v:.3f}" for v in size), all(v <= 0.15 for v in size))
    for place, measure, label in (("tmpfs", "cpu", "CPU time on tmpfs"), ("disk", None, "wall time on disk")):
        samplers = results["select"]["latency"].get(place) if "select" in results else None
        if samplers is None:
            continue
        flat = {name: max(p) / min(p) for name, by_count in samplers.items()
                for p in [[(s[measure] if measure else s)["p50"] for s in by_count.values()]]}
        add("6", f"select {label} flat within 2× from the smallest to the largest buffer, every sampler",
            ", ".join(f"{n} {ratio(v)}" for n, v in flat.items()), max(flat.values()) <= 2)
    if "crashes" not in results:
        return table
    lost = [r["live"]["lost_groups"] for r in results["crashes"].values()]
    add("7", "zero generation work lost with live-store recovery", f"{sum(lost)} groups over {len(lost)} crashes",
        sum(lost) == 0)
    return table


FIGURES = (fig1_commit_latency, fig2_trainer_blocked, fig3_restore, fig4_ingest, fig4b_commit_breakdown, fig5_bytes,
           fig6_select, fig7_work_lost)
