"""Producer put latency through the value store's Ray actor, during a checkpoint and without one.

The TransferQueue backend's owner actor (:data:`kvckpt.integrations.transferqueue.owner.ValueStoreActor`)
serves every put of a job; with ``--actor verl-ledger`` the verl ledger's actor
(:data:`kvckpt.integrations.verl.ledger.VerlLedgerActor`, in the verl venv) is measured instead, its puts
and checkpoints carrying the run token as the mirror's do. A producer in the driver puts one ~28 KB record per call
(``ray.get`` each, as TransferQueue's client does), for ``--seconds`` per phase, into a store holding
``--fill-mb`` MB of values. In the same run, one after the other:

* ``none``: no checkpoint;
* ``serial``: checkpoints called the way the actor was called before it had a checkpoint group:
  in its default group, so every put queued behind a checkpoint waits for the whole copy;
* ``group``: checkpoints in the actor's ``checkpoint`` concurrency group (what the backend's
  client does): puts wait only for the stamp transaction.

In the checkpoint phases a second thread checkpoints back to back; a put counts as "during a
checkpoint" when its call overlaps one. Reported per phase: puts, p50 and p99 of the put latency
(ms), the checkpoints and their mean seconds, and the ratio of each phase's p99 during checkpoints
to ``none``'s p99. The machines are shared and noisy: read the ratios, not the absolutes.

Run: ``python -m benchmarks.value_store_actor [--actor value-store|verl-ledger] [--fill-mb 256] [--seconds 8]
[--phases none,serial,group] [--json out.json]``.
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

from kvckpt.storage import codec

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

    def checkpoint(self, dest: str, *, grouped: bool) -> None:
        call = self.actor.checkpoint.options(concurrency_group="checkpoint") if grouped else self.actor.checkpoint
        ray.get(call.remote(*self.head, dest, *self.tail))


def _fill(owner: _Owner, megabytes: int, rng: np.random.Generator) -> None:
    for start in range(0, megabytes, 16):
        keys = [owner.key(f"fill-{i}") for i in range(start, min(megabytes, start + 16))]
        owner.put(keys, [_record(k, rng.bytes(FILL_VALUE_BYTES)) for k in keys])


def _phase(owner: _Owner, phase: str, seconds: float, directory: str, payload: bytes) -> dict[str, Any]:
    """Put for ``seconds`` while (unless ``none``) another thread checkpoints back to back."""
    windows: list[tuple[float, float]] = []
    stop = threading.Event()

    def checkpoints() -> None:
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            owner.checkpoint(os.path.join(directory, f"{phase}-{n % 2}.kv"), grouped=phase != "serial")
            windows.append((t0, time.perf_counter()))
            n += 1

    thread = threading.Thread(target=checkpoints, daemon=True) if phase != "none" else None
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
    ms = np.array(during) * 1e3
    return {"puts": len(during), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "checkpoints": len(windows),
            "checkpoint_s": float(np.mean([b - a for a, b in windows])) if windows else 0.0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--actor", choices=("value-store", "verl-ledger"), default="value-store",
                        help="the TransferQueue backend's owner actor (default) or the verl ledger's actor")
    parser.add_argument("--fill-mb", type=int, default=256, help="MB of values in the store (default 256)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of puts per phase (default 8)")
    parser.add_argument("--work", default=None, help="directory for the store (default: a temporary one)")
    parser.add_argument("--phases", default=",".join(PHASES), help="the phases to run, of none,serial,group "
                        "(none always runs first; serial alone also runs on a kvckpt without the checkpoint group)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    kray.init_local_ray(num_cpus=2, address="local")  # a cluster of its own, whatever else runs here
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"settings": vars(args), "phases": {}}
    try:
        with tempfile.TemporaryDirectory(dir=args.work) as tmp:
            owner = _Owner(args.actor, os.path.join(tmp, "live.kv"))
            _fill(owner, args.fill_mb, rng)
            payload = rng.bytes(VALUE_BYTES)
            for phase in ["none", *(p for p in args.phases.split(",") if p in PHASES and p != "none")]:
                results["phases"][phase] = _phase(owner, phase, args.seconds, tmp, payload)
            ray.get(owner.actor.close.remote())
    finally:
        ray.shutdown()
    base = results["phases"]["none"]["p99_ms"]
    print(f"{'phase':<8} {'puts':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99 / none':>10} {'ckpts':>6} {'ckpt s':>7}")
    for phase, r in results["phases"].items():
        r["p99_ratio"] = r["p99_ms"] / base
        print(f"{phase:<8} {r['puts']:>6} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['p99_ratio']:>9.2f}x "
              f"{r['checkpoints']:>6} {r['checkpoint_s']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
