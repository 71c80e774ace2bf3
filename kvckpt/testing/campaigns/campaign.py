"""The command line of kvckpt's fault campaigns (the harness of :mod:`kvckpt.testing`).

``python -m kvckpt.testing.campaigns.campaign [--kills N]`` runs the crash campaign
(:func:`kvckpt.testing.campaigns.kill.run_crash_campaign`), ``... fuzz --cases N`` the corruption fuzzing
(:func:`kvckpt.testing.campaigns.fuzz.run_fuzz_campaign`), ``... powercut --cuts N`` the power-loss
campaign (:mod:`kvckpt.testing.campaigns.powercut`) and ``... replicated --kills N --level L`` the kill
campaign's replicated side (:mod:`kvckpt.testing.campaigns.replicated`). Each prints one summary line and exits 1 when a
violation was found. ``child`` and ``fuzz-worker`` are the campaigns' own subprocesses.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvckpt.testing.campaigns.fuzz import fuzz_worker, run_fuzz_campaign
from kvckpt.testing.campaigns.harness import every, report
from kvckpt.testing.campaigns.kill import child_main, run_crash_campaign


def main(argv: list[str] | None = None) -> int:
    """``python -m kvckpt.testing.campaigns.campaign [--kills N] ...``, ``... fuzz --cases N ...`` or
    ``python -m kvckpt.testing.campaigns.campaign powercut --cuts N ...``
    (:mod:`kvckpt.testing.campaigns.powercut`); exits 1 when a violation was found."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and not args[0].startswith("-") else "kill"
    if command == "powercut":  # power loss on a FUSE filesystem: kvckpt.testing.campaigns.powercut
        from kvckpt.testing.campaigns.powercut import main as powercut_main

        return powercut_main(args)
    parser = argparse.ArgumentParser(prog=f"python -m kvckpt.testing.campaigns.campaign {command}")
    parser.add_argument("--seed", type=int, default=0)
    if command == "child":
        parser.add_argument("run")
        parser.add_argument("--recover", action="store_true")
        parser.add_argument("--side", action="append", default=[])
        opts = parser.parse_args(args)
        child_main(opts.run, opts.seed, opts.recover, lambda: print("ready", flush=True), opts.side)
        return 0
    if command == "fuzz-worker":
        parser.add_argument("directory")
        parser.add_argument("--trusted", action="store_true")
        opts = parser.parse_args(args)
        fuzz_worker(opts.directory, opts.trusted)
        return 0
    parser.add_argument("--dir", default=None, help="keep the campaign's files here (default: a temp dir)")
    parser.add_argument("--minutes", type=float, default=None, help="start nothing new after this long")
    if command == "fuzz":
        parser.add_argument("--cases", type=int, default=1000)
        parser.add_argument("--workers", type=int, default=2)
        parser.add_argument("--trusted", action="store_true", help="skip safe_open, to measure what it prevents")
        opts = parser.parse_args(args)
        result: Any = run_fuzz_campaign(opts.cases, seed=opts.seed, workers=opts.workers, directory=opts.dir,
                                        trusted=opts.trusted, minutes=opts.minutes,
                                        progress=every(500, lambda r: r.cases))
    elif command == "replicated":
        from kvckpt.testing.campaigns.replicated import LEVELS, run_replicated_campaign

        parser.add_argument("--kills", type=int, default=200)
        parser.add_argument("--level", choices=LEVELS, default=LEVELS[-1])
        opts = parser.parse_args(args)
        result = run_replicated_campaign(opts.kills, level=opts.level, seed=opts.seed, directory=opts.dir,
                                         minutes=opts.minutes, progress=every(50, lambda r: r.kills))
    elif command == "kill":
        parser.add_argument("--kills", type=int, default=200)
        parser.add_argument("--chain", type=int, default=25, help="kills per live store before a fresh one")
        parser.add_argument("--exec", action="store_true", help="start each child as a fresh interpreter")
        parser.add_argument("--side", action="append", default=[],
                            help="module of a side workload to run and check too (kvckpt.testing.campaigns.sides)")
        opts = parser.parse_args(args)
        result = run_crash_campaign(opts.kills, seed=opts.seed, directory=opts.dir, chain=opts.chain,
                                    fresh_interpreter=opts.exec, minutes=opts.minutes,
                                    progress=every(100, lambda r: r.kills), sides=opts.side)
    else:
        parser.error(f"unknown command {command!r} (use fuzz, powercut, replicated, or --kills N)")
    return report(result)


if __name__ == "__main__":
    sys.exit(main())
