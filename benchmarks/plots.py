"""One PNG per benchmark figure (matplotlib's Agg canvas, no display needed), from :mod:`benchmarks.measure` results.

:func:`plot_all` writes ``fig1_commit_latency.png`` ... ``fig7_work_lost.png`` into a directory
and returns their paths. Curves are over buffer size (GB of raw rows), kvckpt in blue, baselines
in orange/grey; log scales where the two differ by orders of magnitude.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from matplotlib.figure import Figure

KV, BASE, OTHER = "tab:blue", "tab:orange", "tab:gray"


def _sizes(results: dict[str, Any]) -> list[float]:
    return [r["size_gb"] for r in results["sizes"]]


def _axes(title: str, ylabel: str, log: bool = True, xlabel: str = "buffer size (GB of raw rows)") -> tuple[Any, Any]:
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    return fig, ax


def fig1(results: dict[str, Any], ax: Any) -> None:
    """Commit latency p99 and max, with and without a checkpoint running."""
    x = _sizes(results)
    for system, color, name in (("kvckpt", KV, "kvckpt"), ("baseline", BASE, "torch.save under lock")):
        for phase, style, label in (("idle", ":", "no checkpoint"), ("ckpt", "-", "checkpoint running")):
            p99 = [r["load"][system][phase]["commit"]["p99"] * 1e3 for r in results["sizes"]]
            ax.plot(x, p99, style, color=color, marker="o", label=f"{name}, {label} (p99)")
        worst = [r["load"][system]["ckpt"]["commit"]["max"] * 1e3 for r in results["sizes"]]
        ax.plot(x, worst, "--", color=color, marker="x", label=f"{name}, checkpoint running (max)")
    ax.legend(fontsize=7)


def fig2(results: dict[str, Any], ax: Any) -> None:
    """Trainer-blocked time per checkpoint."""
    x = _sizes(results)
    for system, color, name in (("kvckpt", KV, "kvckpt stamp"), ("baseline", BASE, "stop-the-world torch.save")):
        worst = [max(c["blocked"] for c in r["load"][system]["ckpt"]["checkpoints"]) * 1e3 for r in results["sizes"]]
        ax.plot(x, worst, "-", color=color, marker="o", label=f"{name} (max under load)")
    ax.axhline(20, color=OTHER, linestyle=":", label="20 ms target")
    ax.legend(fontsize=8)


def fig3(results: dict[str, Any], ax: Any) -> None:
    """Restore to first batch."""
    x = _sizes(results)
    for mode, color, style, name in (("kvckpt", KV, "-", "kvckpt restore + select + read_batch"),
                                     ("kvckpt_trusted", KV, "--", "same, restore(trusted=True)"),
                                     ("kvckpt_live", KV, ":", "kvckpt live-store recover() + batch (crash path)"),
                                     ("torch", BASE, "-", "torch.load + batch"),
                                     ("torch_mmap", BASE, "--", "torch.load(mmap=True) + batch")):
        if any(mode not in r["restore"] for r in results["sizes"]):
            continue
        ax.plot(x, [r["restore"][mode]["seconds"]["p50"] for r in results["sizes"]], style, color=color, marker="o",
                label=name)
    ax.legend(fontsize=8)


def fig4(results: dict[str, Any], ax: Any) -> None:
    """Durable ingest throughput."""
    x = _sizes(results)
    ing = [r["ingest"] for r in results["sizes"]]
    lines = (("kvckpt, 1 producer", KV, "-", lambda i: i["kvckpt_seconds"]),
             ("kvckpt, N producers", KV, "--", lambda i: i["threads_seconds"]),
             ("bare LMDB put loop (pre-encoded)", BASE, "-", lambda i: i["bare_seconds"]),
             ("bare LMDB encode + put", BASE, "--", lambda i: i["bare_seconds"] + i["encode_seconds"]))
    for name, color, style, seconds in lines:
        ax.plot(x, [i["raw_bytes"] / 1e6 / seconds(i) for i in ing], style, color=color, marker="o", label=name)
    ax.plot(x, [i["disk_seq_write_MBps"] for i in ing], ":", color=OTHER, marker="s",
            label="disk sequential write + fsync")
    ax.legend(fontsize=7)


def fig5(results: dict[str, Any], ax: Any) -> None:
    """Bytes on disk per raw byte."""
    x = _sizes(results)
    raw = [r["ingest"]["raw_bytes"] for r in results["sizes"]]
    series = (("kvckpt checkpoint", KV, "-", lambda r: r["checkpoint_no_load"]["kvckpt"]["file_bytes"]),
              ("kvckpt live file", KV, "--", lambda r: r["ingest"]["kvckpt_file_bytes"]),
              ("torch.save", BASE, "-", lambda r: r["checkpoint_no_load"]["baseline"]["file_bytes"]),
              ("bare LMDB (same values)", OTHER, "--", lambda r: r["ingest"]["bare_file_bytes"]))
    for name, color, style, size in series:
        ax.plot(x, [size(r) / b for r, b in zip(results["sizes"], raw, strict=True)], style, color=color, marker="o",
                label=name)
    ax.axhline(0.15, color=OTHER, linestyle=":", label="0.15 target")
    ax.legend(fontsize=8)


def fig6(results: dict[str, Any], ax: Any) -> None:
    """Select latency against buffered groups."""
    ax.set_xscale("log")
    colors = dict(zip(("in_order", "weight_fifo", "windowed", "ready_first"),
                      ("tab:blue", "tab:green", "tab:purple", "tab:red"), strict=True))
    for place, samplers in results["select"]["latency"].items():
        for name, by_count in samplers.items():
            counts = [int(c) for c in by_count]
            cpu = place != "disk"
            ax.plot(counts, [(s["cpu"] if cpu else s)["p50"] * 1e3 for s in by_count.values()], "--" if cpu else "-",
                    color=colors.get(name, OTHER), marker="o",
                    label=f"{name} ({'tmpfs, CPU' if cpu else 'disk, wall'})")
    ax.legend(fontsize=7, ncol=2)


def fig7(results: dict[str, Any], ax: Any) -> None:
    """Groups lost per crash point."""
    points = list(results["crashes"])
    pos = range(len(points))
    live = [results["crashes"][p]["live"]["lost_groups"] for p in points]
    ckpt = [results["crashes"][p]["checkpoint"]["lost_groups"] for p in points]
    ax.bar([i - 0.2 for i in pos], live, width=0.4, color=KV, label="kvckpt live-store recovery")
    ax.bar([i + 0.2 for i in pos], ckpt, width=0.4, color=BASE, label="checkpoint-only recovery")
    ax.set_xticks(list(pos))
    ax.set_xticklabels(points, fontsize=8)
    ax.legend(fontsize=8)


PLOTS: tuple[tuple[str, str, str, bool, str, Callable[[dict[str, Any], Any], None]], ...] = (
    ("fig1_commit_latency", "Producer commit latency", "ms", True, "", fig1),
    ("fig2_trainer_blocked", "Trainer blocked per checkpoint", "ms", True, "", fig2),
    ("fig3_restore", "Restore to first training batch (fresh process)", "seconds", True, "", fig3),
    ("fig4_ingest", "Durable ingest throughput", "MB/s of raw rows", True, "", fig4),
    ("fig5_bytes", "Bytes on disk per raw byte", "bytes / raw byte", True, "", fig5),
    ("fig6_select", "Select latency (p50) vs buffered groups", "ms", True, "buffered groups", fig6),
    ("fig7_work_lost", "Committed groups lost per crash", "groups", False, "crash point", fig7),
)


def plot_all(results: dict[str, Any], directory: str, only: set[str] | None = None) -> list[str]:
    """Write every figure's PNG (or only those numbered in ``only``) into ``directory`` (created if
    needed); returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, title, ylabel, log, xlabel, draw in PLOTS:
        if only is not None and name[3] not in only:
            continue
        fig, ax = _axes(title, ylabel, log, xlabel) if xlabel else _axes(title, ylabel, log)
        draw(results, ax)
        if not xlabel:  # a curve over buffer sizes: log axis, ticks at the measured sizes
            sizes = _sizes(results)
            ax.set_xscale("log")
            ax.set_xticks(sizes, labels=[f"{x:g}" for x in sizes])
            ax.set_xticks([], minor=True)
        fig.tight_layout()
        path = os.path.join(directory, f"{name}.png")
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
