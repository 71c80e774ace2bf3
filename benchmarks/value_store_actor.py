"""Producer put latency through the value store's Ray actor, during a checkpoint and without one.

The TransferQueue backend's owner actor (:data:`kvckpt.integrations.transferqueue.owner.ValueStoreActor`)
serves every put of a job; with ``--actor verl-ledger`` the verl ledger's actor
(:data:`kvckpt.integrations.verl.ledger.VerlLedgerActor`, in the verl venv) is measured instead, its puts
and checkpoints carrying the run token as the mirror's do. A producer in the driver puts one ~28 KB record per call
(``ray.get`` each, as TransferQueue's client does) into a store holding ``--fill-mb`` MB of values. Phases:

* ``none``: no checkpoint;
* ``serial``: checkpoints called the way the actor was called before it had a checkpoint group:
  in its default group, so every put queued behind a checkpoint waits for the whole copy;
* ``group``: checkpoints in the actor's ``checkpoint`` concurrency group (what the backend's
  client does): puts wait only for the stamp transaction.

The phases run in ``--rounds`` rounds of ``--seconds`` each, interleaved (the order reversed every other round,
ABBA), so a load change on a shared machine falls on every phase alike. In a checkpoint phase a second thread
checkpoints back to back; a put counts as "during a checkpoint" when its call overlaps one. Reported per phase:
puts, p50 and p99 of the put latency (ms) pooled over the rounds, ``p99_ratio`` (pooled p99 over ``none``'s pooled
p99) and the median and range of the per-round ratios (each round's p99 over the same round's ``none``), the
checkpoints, their mean seconds and how they copied. A disk probe in the driver (its own process: it shares the
disk, not the actor's interpreter) times a 4 KB write + fsync of a file of its own every 10 ms: its p99 per phase
shows how much of a put's wait the disk alone explains. The machines are shared and noisy: read the ratios.

Run: ``python -m benchmarks.value_store_actor [--actor value-store|verl-ledger] [--fill-mb 256] [--rounds 6]
[--seconds 4] [--phases none,group] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Any

import kvckpt.integrations.ray as kray  # before ray: keeps Ray on loopback
import numpy as np
import ray
from kvckpt.integrations.transferqueue.owner import ValueStoreActor

from kvckpt import codec

PHASES = ("none", "serial", "group")
VALUE_BYTES = 28_000
FILL_VALUE_BYTES = 1 << 20


def _record(key: str, payload: bytes) -> bytes:
    return codec.encode({"v": np.frombuffer(payload, np.uint8)}, {"k": key, "w": "bench", "t": "bytes"}, 0)


class _Owner:
    """The actor under test, called as its users call it: ``put(keys, records)`` and ``checkpoint(dest)``
    (the value store's), or with the run token first and a step last (the verl ledger's)."""

    def __init__(self, kind: str, path: str) -> None:
        if kind == "verl-ledger":
            from kvckpt.integrations.verl.ledger import VerlLedgerActor

            self.actor = VerlLedgerActor.remote(path)
            self.head: tuple[Any, ...] = (ray.get(self.actor.open_run.remote())["token"],)
            self.tail: tuple[Any, ...] = (0,)
        else:
            self.actor, self.head, self.tail = ValueStoreActor.remote(path), (), ()
        self.kind = kind

    def key(self, name: str) -> str:
        return f"p/train/{name}/f/responses" if self.kind == "verl-ledger" else name

    def put(self, keys: list[str], records: list[bytes]) -> None:
        ray.get(self.actor.put.remote(*self.head, keys, records))

    def checkpoint(self, dest: str, *, grouped: bool) -> dict[str, Any]:
        call = self.actor.checkpoint.options(concurrency_group="checkpoint") if grouped else self.actor.checkpoint
        return ray.get(call.remote(*self.head, dest, *self.tail))


def _fill(owner: _Owner, megabytes: int, rng: np.random.Generator) -> None:
    for start in range(0, megabytes, 16):
        keys = [owner.key(f"fill-{i}") for i in range(start, min(megabytes, start + 16))]
        owner.put(keys, [_record(k, rng.bytes(FILL_VALUE_BYTES)) for k in keys])


def _pct(seconds: list[float], q: float) -> float:
    return float(np.percentile(np.array(seconds) * 1e3, q)) if seconds else float("nan")


class _DiskProbe:
    """A 4 KB write + fsync of a file of its own every 10 ms on the store's disk, in the driver's process."""

    def __init__(self, directory: str) -> None:
        self.fd = os.open(os.path.join(directory, "disk-probe"), os.O_RDWR | os.O_CREAT, 0o600)
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        block = b"x" * 4096
        while not self.stop.is_set():
            os.pwrite(self.fd, block, 0)
            t0 = time.perf_counter()
            os.fsync(self.fd)
            self.times.append(time.perf_counter() - t0)
            time.sleep(0.01)

    def __enter__(self) -> _DiskProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        os.close(self.fd)


def _window(owner: _Owner, phase: str, seconds: float, directory: str, payload: bytes) -> dict[str, Any]:
    """Put for ``seconds`` while (unless ``none``) another thread checkpoints back to back: the put latencies
    (during a checkpoint, for a checkpoint phase), the disk probe's fsync times, the checkpoints' seconds and hows."""
    windows: list[tuple[float, float]] = []
    hows: list[str] = []
    stop = threading.Event()

    def checkpoints() -> None:
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            stamp = owner.checkpoint(os.path.join(directory, f"{phase}-{n % 2}.kv"), grouped=phase != "serial")
            windows.append((t0, time.perf_counter()))
            hows.append(str(stamp.get("how", "?")))
            n += 1

    thread = threading.Thread(target=checkpoints, daemon=True) if phase != "none" else None
    with _DiskProbe(directory) as probe:
        if thread is not None:
            thread.start()
        puts: list[tuple[float, float]] = []
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end or (thread is not None and not windows):
            key = owner.key(f"{phase}-{i % 512}")
            t0 = time.perf_counter()
            owner.put([key], [_record(key, payload)])
            puts.append((t0, time.perf_counter()))
            i += 1
        stop.set()
        if thread is not None:
            thread.join()
    during = [b - a for a, b in puts if phase == "none" or any(a < w1 and b > w0 for w0, w1 in windows)]
    return {"put_s": during, "probe_s": probe.times, "checkpoint_s": [b - a for a, b in windows], "how": hows}


def _summary(windows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures, pooled over its rounds; per-round p99 ratios against ``base`` (``none``'s rounds)."""
    puts = [x for w in windows for x in w["put_s"]]
    probe = [x for w in windows for x in w["probe_s"]]
    ckpts = [x for w in windows for x in w["checkpoint_s"]]
    rounds = [_pct(w["put_s"], 99) / _pct(b["put_s"], 99) for w, b in zip(windows, base, strict=True)]
    return {"puts": len(puts), "p50_ms": _pct(puts, 50), "p99_ms": _pct(puts, 99),
            "round_p99_ms": [_pct(w["put_s"], 99) for w in windows], "round_ratios": rounds,
            "round_ratio_median": float(np.median(rounds)), "round_ratio_range": [min(rounds), max(rounds)],
            "probe_fsync_p50_ms": _pct(probe, 50), "probe_fsync_p99_ms": _pct(probe, 99),
            "checkpoints": len(ckpts), "checkpoint_s": float(np.mean(ckpts)) if ckpts else 0.0,
            "how": sorted({h for w in windows for h in w["how"]})}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actor", choices=("value-store", "verl-ledger"), default="value-store",
                        help="the TransferQueue backend's owner actor (default) or the verl ledger's actor")
    parser.add_argument("--fill-mb", type=int, default=256, help="MB of values in the store (default 256)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of puts per phase and round (default 4)")
    parser.add_argument("--work", default=None, help="directory for the store (default: a temporary one)")
    parser.add_argument("--phases", default="none,group", help="the phases to run, of none,serial,group "
                        "(none always runs; serial alone also runs on a kvckpt without the checkpoint group)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    kray.init_local_ray(num_cpus=2, address="local")  # a cluster of its own, whatever else runs here
    rng = np.random.default_rng(0)
    phases = ["none", *(p for p in args.phases.split(",") if p in PHASES and p != "none")]
    windows: dict[str, list[dict[str, Any]]] = {p: [] for p in phases}
    load = [os.getloadavg()[0]]
    try:
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            owner = _Owner(args.actor, os.path.join(tmp, "live.kv"))
            _fill(owner, args.fill_mb, rng)
            payload = rng.bytes(VALUE_BYTES)
            for n in range(args.rounds):
                for phase in phases if n % 2 == 0 else phases[::-1]:
                    windows[phase].append(_window(owner, phase, args.seconds, tmp, payload))
                load.append(os.getloadavg()[0])
            ray.get(owner.actor.close.remote())
    finally:
        ray.shutdown()
    results: dict[str, Any] = {"settings": vars(args), "load_average": load,
                               "phases": {p: _summary(windows[p], windows["none"]) for p in phases}}
    base = results["phases"]["none"]["p99_ms"]
    print(f"{args.actor}, {args.rounds} rounds x {args.seconds:g} s, load average {min(load):.1f}-{max(load):.1f}")
    print(f"{'phase':<8} {'puts':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99/none':>9} {'rounds: median (range)':>24} "
          f"{'disk fsync p50/p99':>19} {'ckpts':>6} {'ckpt s':>7}")
    for phase, r in results["phases"].items():
        r["p99_ratio"] = r["p99_ms"] / base
        lo, hi = r["round_ratio_range"]
        print(f"{phase:<8} {r['puts']:>6} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['p99_ratio']:>8.2f}x "
              f"{r['round_ratio_median']:>10.2f}x ({lo:.2f}-{hi:.2f}) "
              f"{r['probe_fsync_p50_ms']:>8.2f}/{r['probe_fsync_p99_ms']:<8.2f} {r['checkpoints']:>6} "
              f"{r['checkpoint_s']:>7.2f} {','.join(r['how'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
