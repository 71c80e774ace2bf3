"""kvckpt: look into, check, copy, export and compare kvckpt stores; run the demo.

Every command works on a live store or a checkpoint file, opens its inputs read-only without
creating lock files, never modifies them, prints a readable report (``--json`` prints JSON
instead) and exits 0 when all is well, 1 when it found problems (a damaged, crafted or foreign
file included, the same status from every command; ``diff``: differences), 2 on a usage or I/O
error (one line on stderr). Long work shows a progress bar on a terminal. Every input goes
through :func:`kvckpt.durability.safe_open.open_readonly` (structure-checked before liblmdb maps it), and
control characters from a file (group ids, messages) are printed escaped, never raw.

inspect PATH
    Identity, config, counts by state, ledger, cursors, checkpoint stamp, sizes, histograms.
    ``kvckpt inspect ckpt/step_0100.kvckpt``
verify PATH [--deep] [--against OTHER]
    Check every invariant and every stored value's checksum (at least what ``restore()`` checks
    before it hands out leases); ``--deep`` also decodes every row (schema, dtypes, shapes, sizes:
    what ``read_batch`` checks). Both print one line saying what they did not check.
    ``--against OTHER`` instead compares two replicas (docs/replication.md): equal when both are at
    the same log sequence and every table's digest matches.
    ``kvckpt verify --deep live.kv``
compact SRC DEST [--level N] [--force]
    Write a compacted single-file copy, optionally re-encoding rows at zstd level N.
    ``kvckpt compact live.kv compact.kv --level 3``
export PATH OUT --format parquet|jsonl [--state S,...] [--steps A:B] [--fields F,...] [--decode TOKENIZER]
    Stream rows with their group metadata to Parquet or JSONL.
    ``kvckpt export ckpt.kvckpt sft.parquet --format parquet --state consumed --steps 0:100``
diff A B [--rows]
    Groups added, removed and changed, ledger and cursor differences.
    ``kvckpt diff ckpt/step_0090.kvckpt ckpt/step_0100.kvckpt``
demo [--fast] [--sampler NAME] [--recovery live|checkpoint] [--backend B] [--no-model] [--out DIR]
    The reference GRPO trainer SIGKILLed mid-step, resumed in a new process, audited (a recovery
    report and a learning-curve PNG); ``--no-model``: the model-free producer/consumer run.
    ``kvckpt demo --fast --recovery checkpoint``

Why this module is long (about 590 lines): it is the whole command line, one section per verb (its
report renderer and its ``cmd_`` function, 20 to 90 lines each), the output helpers they share and
the parser; the work itself is in :mod:`kvckpt.tools` and the demos.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvckpt.errors import CorruptRecord, FormatError, InvariantViolation, KvckptError, RecoveryError

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


# -- output helpers ------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every C0/C1 control character (ESC, BEL, newline...) written as ``\\xNN``, so
    nothing read from a file can drive the terminal or forge an output line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)

def _size(n: int | None) -> str:
    """Bytes for people: ``1.23 MiB``."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    """Aligned columns: numbers right-aligned, text left-aligned.

    Written here, not taken from a library: none of kvckpt's dependencies (lmdb, zstandard, numpy,
    torch) formats text tables, and the stdlib has no table formatter. ``rich`` (installed here
    only as another package's dependency) would be a new core dependency for these lines, and
    would wrap at the terminal's width and interpret ``[...]`` markup in file-controlled strings
    (group ids, messages) unless each were escaped: this tool prints untrusted text
    (:func:`printable`)."""
    cells = [[_num(c) for c in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    return [line(list(headers))] + [line(r) for r in cells]


def _pairs(items: Sequence[tuple[str, Any]], indent: str = "  ") -> list[str]:
    """``label  value`` lines with the labels padded to one width."""
    width = max((len(k) for k, _ in items), default=0)
    return [f"{indent}{k.ljust(width)}  {v}" for k, v in items]


def _limit(rows: list[Any], limit: int) -> tuple[list[Any], int]:
    return rows[:limit], max(0, len(rows) - limit)


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


class _Bar:
    """A tqdm bar fed with ``(done, total)``; silent when stdout is not a terminal or tqdm is missing."""

    def __init__(self, desc: str, unit: str = "it", enabled: bool = True, scale: bool = False) -> None:
        self._bar: Any = None
        self._args = {"desc": desc, "unit": unit, "unit_scale": scale, "unit_divisor": 1024 if scale else 1000,
                      "leave": False, "dynamic_ncols": True}
        self._enabled = enabled and sys.stdout.isatty() and sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
            except ImportError:
                self._enabled = False
                return
            self._bar = tqdm(total=total, **self._args)
        if total != self._bar.total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    @property
    def enabled(self) -> bool:
        """Whether the bar will be drawn (a terminal, tqdm importable so far)."""
        return self._enabled

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _progress(args: argparse.Namespace, desc: str, unit: str = "it", scale: bool = False) -> _Bar:
    return _Bar(desc, unit, enabled=not args.json, scale=scale)


class _PhasedBar:
    """One bar per phase of a ``progress(phase, done, total)`` callback (a phase has its own unit)."""

    def __init__(self, args: argparse.Namespace, phases: dict[str, tuple[str, bool]]) -> None:
        self._bars = {name: _progress(args, name, unit, scale) for name, (unit, scale) in phases.items()}

    def __call__(self, phase: str, done: int, total: int) -> None:
        for name, bar in self._bars.items():
            if name != phase:
                bar.close()  # phases run one after the other: one line on the terminal
        self._bars[phase](done, total)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


def _emit(args: argparse.Namespace, doc: dict[str, Any], render: Callable[[dict[str, Any]], list[str]]) -> None:
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print("\n".join(printable(line) for line in render(doc)))


# -- inspect -------------------------------------------------------------------------------------
def _sampler_text(sampler: dict[str, Any] | None) -> str:
    if not sampler:
        return "-"
    extra = ", ".join(f"{k}={v}" for k, v in sampler.items() if k != "name")
    return f"{sampler['name']}({extra})"


def _ratio(raw: int, stored: int) -> str:
    """How compression changed the rows, in words that cannot be misread when it made them larger."""
    if not raw or not stored:
        return "-"
    if stored > raw:
        return f"{stored / raw:.2f}x larger than raw: these rows are too small to compress"
    return f"{raw / stored:.2f}x smaller than raw"


def _render_replication(rep: dict[str, Any] | None) -> list[str]:
    """The replication section of ``inspect`` (docs/replication.md), empty for a store not replicated."""
    if rep is None:
        return []
    pairs = [("role", rep["role"]), ("epoch", rep["epoch"]), ("last sequence", rep["last"])]
    if rep["role"] == "standby":
        pairs.append(("applied sequence", rep["applied"]))
    else:
        pairs += [("standby acknowledged", rep["acked"]), ("standby lag", f"{rep['lag_records']:,} records"),
                  ("standby", rep["standby"] + (": needs a snapshot catch-up" if rep["standby"] == "snapshot" else "")),
                  ("log kept", f"{rep['records']:,} records (bound {rep['max_records']:,})")]
    return ["", "replication", *_pairs(pairs)]


def _render_inspect(doc: dict[str, Any]) -> list[str]:
    ident, cfg = doc["identity"], doc.get("config")
    live = "live: a writer holds it" if doc["live"] else "no writer"
    out = [f"kvckpt store {doc['path']}  ({live})"]
    out += _pairs([("store id", ident["store_id"]), ("format", f"{ident['format']} v{ident['version']}"),
                   ("created", _when(ident.get("created")))])
    out += _render_replication(doc.get("replication"))
    if doc["kind"] == "values":
        return out + _render_values(doc) + _problem_lines(doc)
    if cfg is None:
        out.append("  (no readable replay buffer config in this store)")
        return out + _problem_lines(doc)
    schema = ", ".join(f"{n} {d} {k}" for n, (d, k) in cfg["schema"]["fields"].items())
    out += ["", "config"]
    out += _pairs([("sampler", _sampler_text(cfg["sampler"])), ("group size n", cfg["group_size"]),
                   ("capacity", f"{cfg['max_buffered_rollouts']} groups (max_buffered_rollouts)"),
                   ("groups per step", cfg["groups_per_step"]), ("schema", schema),
                   ("compression", f"zstd level {cfg['compression_level']}" if cfg["compression_level"] else "none"),
                   ("retain consumed", _num(cfg["retain_consumed"])),
                   ("durable checkpoints", cfg.get("durable_checkpoints"))])
    counts = doc["counts"]
    out += ["", "groups"]
    out += _table(["state", "count"], [[name, counts[name]] for name in
                                       ("inflight", "ready", "claimed", "consumed", "evicted", "aborted")]
                  + [["total", counts["groups"] + counts["inflight"]], ["rows stored", counts["rows"]]])
    ledger = doc["ledger"]
    out += ["", f"ledger  {ledger['count']:,} in flight, {ledger['partial']:,} with finished siblings"
                + (f"; first {len(ledger['first'])}:" if ledger["first"] else "")]
    if ledger["first"]:
        out += _table(["group_id", "prompt_idx", "task", "target_step", "start_weight", "attempt", "siblings"],
                      [[e["group_id"], e["prompt_idx"], e["task_name"], e["target_step"], e["start_weight"],
                        e["attempt"], ",".join(map(str, e["siblings"])) or "-"] for e in ledger["first"]])
    tokens = doc["progress"]
    out += ["", f"progress  {tokens['samples']:,} samples generating, {tokens['chunks']:,} chunks, "
                f"{tokens['tokens']:,} durable tokens"]
    cur, stamp = doc["cursors"] or {}, doc["checkpoint"]
    out += ["", "cursors"]
    out += _pairs([(k, _num(cur.get(k))) for k in ("dispatch_index", "trainer_version", "weight_version",
                                                   "admissions")]
                  + [("durable at", ", ".join(map(str, cur.get("durable") or [])) or "-"),
                     ("dataloader state", "-" if doc["dataloader_state_bytes"] is None
                      else f"{doc['dataloader_state_bytes']:,} bytes"),
                     ("batch shortfall", ", ".join(f"step {k}: {v}" for k, v in doc["batch_shortfall"].items())
                      or "-")])
    out += ["", "last checkpoint"]
    if stamp is None:
        out.append("  none")
    else:
        out += _pairs([("step", _num(stamp["trainer_version"])), ("id", stamp["checkpoint_id"]),
                       ("written", _when(stamp.get("created"))), ("file", stamp.get("file") or "-"),
                       ("trainer state", json.dumps(stamp.get("trainer_state") or {}))])
    size = doc["bytes"]
    ratio = _ratio(size["raw"], size["stored"])
    weights = doc["weights"]
    out += ["", "bytes and versions"]
    out += _table(["", "bytes", "human"], [["rows raw", size["raw"], _size(size["raw"])],
                                          ["rows stored", size["stored"], f"{_size(size['stored'])} ({ratio})"],
                                          ["LMDB pages used", size["lmdb_pages_used"], _size(size["lmdb_pages_used"])],
                                          ["file", size["file"], _size(size["file"])]])
    out += ["", "weight versions (start_weight)"]
    out += _pairs([("held", "{oldest}..{newest}  (groups with rows, and in flight)".format(**weights["held"])),
                   ("ever", "{oldest}..{newest}  (every record, tombstones included)".format(**weights["all"]))])
    lineage = doc.get("lineage") or {}
    if lineage.get("forked") or lineage.get("spanning"):  # after a rollback, or tokens of two weights
        out += _pairs([("lineage", f"{lineage['forked']} held on a destroyed lineage (lowest lineage weight "
                                   f"{lineage['lowest'] if lineage['lowest'] is not None else '-'}), "
                                   f"{lineage['spanning']} spanning a weight sync")])
    hist = doc["histogram"]
    if hist["by_weight"]:
        rows, more = _limit(hist["by_weight"], 30)
        out += ["", "by weight version (start_weight)"]
        out += _table(["weight", "inflight", "ready", "claimed", "consumed", "evicted", "aborted"],
                      [[r["weight"], r["inflight"], r["ready"], r["claimed"], r["consumed"], r["evicted"],
                        r["aborted"]] for r in rows])
        out += [f"  ... {more} more (see --json)"] if more else []
    if hist["by_step"]:
        rows, more = _limit(hist["by_step"], 30)
        out += ["", "by training step"]
        out += _table(["step", "planned in flight", "planned ready", "claimed now", "consumed"],
                      [[r["step"], r["target_inflight"], r["target_ready"], r["claimed"], r["consumed"]]
                       for r in rows])
        out += [f"  ... {more} more (see --json)"] if more else []
    return out + _problem_lines(doc)


def _render_values(doc: dict[str, Any]) -> list[str]:
    marker, stamp, size = doc["value_store"] or {}, doc["checkpoint"], doc["bytes"]
    out = ["", f"value store  {marker.get('kind')} v{marker.get('version')}  (a TransferQueue backend or verl ledger)"]
    out += _pairs([("values", f"{doc['values']:,}"), ("stored", f"{size['stored']:,} bytes ({_size(size['stored'])})"),
                   ("file", f"{size['file']:,} bytes ({_size(size['file'])})")])
    out += ["", "last checkpoint"]
    if stamp is None:
        return [*out, "  none"]
    return out + _pairs([("id", stamp.get("checkpoint_id")), ("written", _when(stamp.get("created"))),
                         ("file", stamp.get("file") or "-")])


def _problem_lines(doc: dict[str, Any]) -> list[str]:
    if not doc["problems"]:
        return []
    return ["", f"{len(doc['problems'])} damaged record(s) (run `kvckpt verify`):",
            *[f"  {p['key']}: {p['problem']}" for p in doc["problems"][:20]]]


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvckpt.tools.inspect import inspect_path

    _require_file(args.path)
    bar = _progress(args, "scanning", "records")
    try:
        doc = inspect_path(args.path, ledger_limit=args.ledger, progress=bar)
    finally:
        bar.close()
    _emit(args, doc, _render_inspect)
    return EXIT_PROBLEMS if doc["problems"] else EXIT_OK


# -- verify --------------------------------------------------------------------------------------
def _render_verify(doc: dict[str, Any]) -> list[str]:
    counts = doc["counts"]
    seen = ", ".join(f"{k} {v:,}" for k, v in counts.items() if not k.startswith("groups_"))
    head = f"{doc['path']}: {'ok' if doc['ok'] else str(len(doc['problems'])) + ' problem(s)'}"
    out = [head + (f"  ({seen}; {'deep: every row decoded' if doc['deep'] else 'rows checksummed, not decoded'})"
                   if counts else "")]
    out += [f"  [{p['code']}] {p['key']}: {p['message']}" for p in doc["problems"]]
    if doc.get("not_checked"):
        out.append(f"  not checked: {doc['not_checked']}")
    return out


def _render_against(doc: dict[str, Any]) -> list[str]:
    this, that = doc["this"], doc["that"]
    verdict = ("the same state" if doc["equal"] else
               "not at the same sequence" if not doc["same_sequence"] else
               f"different tables: {', '.join(doc['differing'])}")
    return [f"{doc['path']} ({this['role'] or 'not replicated'}, epoch {this['epoch']}, sequence {this['sequence']}) "
            f"vs {doc['other']} ({that['role'] or 'not replicated'}, epoch {that['epoch']}, sequence "
            f"{that['sequence']}): {verdict}"]


def cmd_verify(args: argparse.Namespace) -> int:
    if args.against is not None:  # replicas: the same state at the same sequence (docs/replication.md)
        from kvckpt.tooling import compare_replicas
        _require_file(args.path)
        _require_file(args.against)
        doc = compare_replicas(args.path, args.against)
        _emit(args, doc, _render_against)
        return EXIT_OK if doc["equal"] else EXIT_PROBLEMS

    from kvckpt import verify_path
    from kvckpt.tooling import open_readonly

    _require_file(args.path)
    bar = _progress(args, "verifying rows", "rows")
    total = 0
    if bar.enabled:  # the bar's total: one more checked open, only on a terminal
        try:
            with open_readonly(args.path) as store:
                total = store.read(lambda t: t.count("rows"))
        except KvckptError:
            pass  # verify_path reports why the file does not open
    try:
        report = verify_path(args.path, deep=args.deep, checksums=True,
                             progress=(lambda done: bar(done, total)) if bar.enabled else None)
    finally:
        bar.close()
    _emit(args, {"path": args.path, "deep": args.deep, **report.to_dict()}, _render_verify)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


# -- compact -------------------------------------------------------------------------------------
def _render_compact(doc: dict[str, Any]) -> list[str]:
    before, after = doc["bytes_before"], doc["bytes_after"]
    change = f"{(after - before) / before:+.1%}" if before else "-"
    out = [f"compacted {doc['src']} -> {doc['dest']} in {doc['seconds']:.2f} s"]
    out += _table(["", "bytes", "human"], [["before", before, _size(before)], ["after", after, _size(after)],
                                          ["change", after - before, change]])
    if doc["level"] is not None:
        out.append(f"  re-encoded {doc['rows_reencoded']:,} rows at zstd level {doc['level']}: row payloads "
                   f"{_size(doc['stored_before'])} -> {_size(doc['stored_after'])}")
    return out


def cmd_compact(args: argparse.Namespace) -> int:
    from kvckpt.tools.compact import compact

    _require_file(args.src)
    bar = _PhasedBar(args, {"copy": ("B", True), "re-encode": ("rows", False)})
    try:
        result = compact(args.src, args.dest, level=args.level, force=args.force, progress=bar)
    finally:
        bar.close()
    _emit(args, result.to_dict(), _render_compact)
    return EXIT_OK


# -- export --------------------------------------------------------------------------------------
def _render_export(doc: dict[str, Any]) -> list[str]:
    rate = doc["raw_bytes"] / doc["seconds"] / 1e6 if doc["seconds"] else 0.0
    return [f"exported {doc['rows']:,} rows of {doc['groups']:,} groups to {doc['path']} ({doc['format']})",
            *_pairs([("fields", ", ".join(doc["fields"])), ("raw row bytes", _size(doc["raw_bytes"])),
                     ("file", _size(doc["file_bytes"])),
                     ("time", f"{doc['seconds']:.2f} s ({rate:.1f} MB/s of raw rows)")])]


def _csv(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def cmd_export(args: argparse.Namespace) -> int:
    from kvckpt.tools.export import export, parse_steps

    _require_file(args.path)
    steps = parse_steps(args.steps) if args.steps is not None else None
    bar = _progress(args, "exporting", "groups")
    try:
        result = export(args.path, args.out, fmt=args.format, states=_csv(args.state), steps=steps,
                        fields=_csv(args.fields), tokenizer=args.decode, force=args.force,
                        batch_bytes=int(args.batch_mb * 2**20), progress=bar, sft=args.sft,
                        completion_mask=args.completion_mask)
    finally:
        bar.close()
    _emit(args, result.to_dict(), _render_export)
    for warning in result.warnings:
        print(f"kvckpt export: warning: {warning}", file=sys.stderr)
    return EXIT_PROBLEMS if args.strict and result.warnings else EXIT_OK


# -- diff ----------------------------------------------------------------------------------------
def _render_table_diff(name: str, diff: dict[str, Any], limit: int = 20) -> list[str]:
    c = diff["counts"]
    out = [f"{name}  {c['added']:,} added, {c['removed']:,} removed, {c['changed']:,} changed, {c['same']:,} same"]
    for kind, sign in (("added", "+"), ("removed", "-")):
        keys, more = _limit(diff[kind], limit)
        out += [f"  {sign} {k}" for k in keys] + ([f"  ... {more} more"] if more else [])
    changed, more = _limit(list(diff["changed"].items()), limit)
    for key, fields in changed:
        out.append(f"  ~ {key}: " + ", ".join(f"{f} {a!r} -> {b!r}" if f != "rows" else "rows differ"
                                              for f, (a, b) in fields.items()))
    out += [f"  ... {more} more"] if more else []
    return out


def _render_diff(doc: dict[str, Any]) -> list[str]:
    out = [f"A {doc['a']}", f"B {doc['b']}", ""]
    out += [f"note: {n}" for n in doc["notes"]]
    for section in ("identity", "config", "cursors"):
        values = doc[section]
        if values:
            out.append(f"{section}  {len(values)} differ")
            out += _table(["key", "A", "B"], [[k, json.dumps(a), json.dumps(b)] for k, (a, b) in values.items()])
        else:
            out.append(f"{section}  same")
    out += _render_table_diff("groups", doc["groups"])
    out += _render_table_diff("ledger", doc["ledger"])
    out.append("")
    out.append("same" if doc["same"] else "different")
    return out


def cmd_diff(args: argparse.Namespace) -> int:
    from kvckpt.tools.diff import diff_paths

    _require_file(args.a)
    _require_file(args.b)
    bar = _progress(args, "comparing", "records")
    try:
        result = diff_paths(args.a, args.b, rows=args.rows, progress=bar)
    finally:
        bar.close()
    _emit(args, result.to_dict(), _render_diff)
    return EXIT_OK if result.same else EXIT_PROBLEMS


# -- demo ----------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from kvckpt.reference.report import render

    log = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    if args.no_model:
        from kvckpt.reference.model_free_demo import run_demo as run_model_free

        from kvckpt.errors import BadArgument

        if args.steps is not None:
            raise BadArgument("--steps is an option of the model demo, not of --no-model")
        report = run_model_free(args.out, fast=args.fast, sampler=args.sampler, recovery=args.recovery, log=log)
    else:
        from kvckpt.reference.demo import run_demo

        report = run_demo(args.out, fast=args.fast, steps=args.steps, sampler=args.sampler,
                          recovery=args.recovery, backend=args.backend, log=log)
    _emit(args, report, render)
    return EXIT_OK if report["ok"] else EXIT_PROBLEMS


# -- parsing -------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) that name the command's help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 22, got {text!r}") from None
    if not 0 <= value <= 22:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 22, got {value}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _require_file(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    if not os.path.isfile(path):
        raise IsADirectoryError(f"{path!r} is not a file (a kvckpt store is one file)")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvckpt`` argument parser (one subparser per command)."""
    from kvckpt.reference.model_free_demo import RECOVERY_MODES, SAMPLERS
    from kvckpt.tools.export import FORMATS

    from kvckpt import __version__

    parser = _Parser(prog="kvckpt", description="Inspect, verify, compact, export and diff kvckpt stores and "
                     "checkpoint files (opened read-only, never modified); run the crash/recovery demo.",
                     epilog="Exit status: 0 ok, 1 problems or differences found (a damaged or foreign file too), "
                     "2 usage or I/O error.")
    parser.add_argument("--version", action="version", version=f"kvckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    store = ("path", "a live store or a checkpoint file")

    def command(name: str, func: Callable[[argparse.Namespace], int], help_text: str, example: str,
                *positionals: tuple[str, str]) -> argparse.ArgumentParser:
        """A subcommand running ``func``, with ``--json`` and the ``(name, help)`` positionals."""
        p = sub.add_parser(name, help=help_text, description=f"{help_text}.", epilog=f"example: {example}")
        p.add_argument("--json", action="store_true", help="print JSON instead of the readable report")
        for dest, help_arg in positionals:
            p.add_argument(dest, help=help_arg)
        p.set_defaults(func=func)
        return p

    p = command("inspect", cmd_inspect, "Show a store's identity, config, counts, ledger, cursors, sizes and "
                "histograms", "kvckpt inspect ckpt/step_0100.kvckpt", store)
    p.add_argument("--ledger", type=int, default=5, metavar="N", help="ledger entries to list (default 5)")

    p = command("verify", cmd_verify, "Check every invariant of a store (exit 1 if any problem)",
                "kvckpt verify --deep live.kv", store)
    p.add_argument("--deep", action="store_true", help="also decode every row payload (schema, dtypes, shapes, "
                   "sizes)")
    p.add_argument("--against", metavar="OTHER", help="instead, compare with the replica OTHER: the digest of every "
                   "table at the same log sequence (exit 1 unless equal)")

    p = command("compact", cmd_compact, "Write a compacted single-file copy of a store",
                "kvckpt compact live.kv compact.kv --level 3", ("src", "the store to copy (not modified)"),
                ("dest", "the file to write (temporary name, fsync, rename)"))
    p.add_argument("--level", type=_level, metavar="N", help="re-encode row payloads at zstd level N (0 = none)")
    p.add_argument("--force", action="store_true", help="replace DEST if it exists")

    p = command("export", cmd_export, "Export rows with their group metadata to Parquet or JSONL",
                "kvckpt export ckpt.kvckpt sft.parquet --format parquet --state consumed --steps 0:100", store,
                ("out", "the file to write (temporary name, fsync, rename)"))
    p.add_argument("--format", required=True, choices=FORMATS, help="parquet (analysis, SFT data) or jsonl (a look)")
    p.add_argument("--state", metavar="S,...",
                   help="group states to export (default ready,claimed,consumed: those with rows)")
    p.add_argument("--steps", metavar="A:B",
                   help="only groups claimed or consumed at training steps A <= step < B (either end optional)")
    p.add_argument("--fields", metavar="F,...", help="row fields to export (default: all)")
    p.add_argument("--decode", metavar="TOKENIZER",
                   help="add a text column: input_ids detokenized (special tokens skipped) with a local Hugging "
                        "Face tokenizer directory")
    p.add_argument("--sft", action="store_true",
                   help="SFT layout: add store_id, prompt_ids and completion_ids (and prompt/completion text "
                        "with --decode), split where the completion mask first turns on")
    p.add_argument("--completion-mask", default="token_mask", metavar="FIELD",
                   help="with --sft: the token field that is non-zero on completion tokens (default token_mask)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when the export warns (nothing matched, or matching groups have no rows)")
    p.add_argument("--batch-mb", type=_positive, default=32, metavar="MB",
                   help="raw MiB of rows buffered per batch (one Parquet row group); bounds memory (default 32)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")

    p = command("diff", cmd_diff, "Show what differs between two stores (exit 1 if anything does)",
                "kvckpt diff ckpt/step_0090.kvckpt ckpt/step_0100.kvckpt",
                ("a", "the first store or checkpoint file"), ("b", "the second store or checkpoint file"))
    p.add_argument("--rows", action="store_true", help="compare decoded rows instead of digests")

    p = command("demo", cmd_demo, "Train the reference GRPO setup, SIGKILL it mid-step, resume in a new process "
                "and audit it", "kvckpt demo --fast --recovery checkpoint")
    p.add_argument("--fast", action="store_true", help="the small run (12 steps instead of 60)")
    p.add_argument("--steps", type=int, metavar="N", help="train N steps (default 60; the checkpoint period and "
                                                          "the crash step scale with it)")
    p.add_argument("--backend", choices=("transformers", "vllm"),
                   help="generation backend (default: vllm when importable, else transformers)")
    p.add_argument("--no-model", action="store_true",
                   help="the model-free producer/consumer demo instead (numpy rollouts, about 15 s with --fast)")
    p.add_argument("--sampler", choices=SAMPLERS, default="in_order", help="the sampler (default in_order)")
    p.add_argument("--recovery", choices=RECOVERY_MODES, default="live",
                   help="recover the crashed live store (default) or restore the latest checkpoint file")
    p.add_argument("--out", metavar="DIR", help="keep every file of the run in DIR (default: a new temporary "
                                                "directory that keeps only the learning curve and metrics)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 problems found, 2 usage or I/O error)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("kvckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kvckpt inspect x | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (CorruptRecord, InvariantViolation, FormatError, RecoveryError) as exc:
        print(printable(f"kvckpt {args.command}: {exc}"), file=sys.stderr)
        return EXIT_PROBLEMS
    except (KvckptError, OSError) as exc:
        print(printable(f"kvckpt {args.command}: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
