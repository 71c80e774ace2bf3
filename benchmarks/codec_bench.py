"""Record codec vs raw bytes vs ``torch.save`` on realistic GRPO rollout rows.

Run ``python -m benchmarks.codec_bench`` (about 200 MB of padded tensors, < 60 s) or add ``--quick``
(3 MB, < 5 s). Prints Markdown tables.

Data: groups of 16 rows as an async GRPO trainer holds them, from :mod:`benchmarks.data` (one
prompt of ~300 tokens shared by 16 lognormal responses of ~900 tokens, ids from a Zipf(1.05) law
over the 151,936-entry Qwen2.5 vocabulary, i.i.d.: a pessimistic case for zstd), padded to the
group's longest row with the pad id 151643:

* ``input_ids`` int64 [16, L] — prompt + response, then padding
* ``generation_logprobs`` float32 [16, L] — negative on response tokens (mostly near 0, long tail),
  0 on prompt and padding
* ``token_mask`` int64 [16, L] — 1 on response tokens
* ``sample_mask`` float32 [16], ``total_reward`` float32 [16] (0/1), ``input_lengths`` int64 [16]

"raw" is the padded tensors' bytes (``numpy().tobytes()``): every ratio and MB/s below is relative
to it. kvckpt stores one record per row, jagged (each row cut to its own length, no padding);
"padded" rows keep the padding so that the effect of dropping it is visible on its own. "LMDB
pages" adds what LMDB spends to hold each value (values above ~2 KB take whole 4 KiB overflow pages).
Speeds are per CPU second of the measuring thread, best of 3 round-robin rounds (quick: 2), so a
busy machine skews them less.
"""

from __future__ import annotations

import argparse
import io
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from benchmarks.data import ROW_FIELDS, TOKEN_FIELDS, RolloutSpec, iter_groups
from kvckpt import codec

GROUP = RolloutSpec().group_size
PAGE = 4096
NODE_MAX = 2040  # LMDB 0.9 (4 KiB pages): larger values go to overflow pages


# -- data ----------------------------------------------------------------------------------------
def rows_of(group: dict[str, np.ndarray], jagged: bool) -> list[dict[str, np.ndarray]]:
    rows = []
    for i in range(GROUP):
        n = int(group["input_lengths"][i]) if jagged else group["input_ids"].shape[1]
        row = {f: group[f][i, :n] for f in TOKEN_FIELDS}
        row.update({f: group[f][i] for f in ROW_FIELDS})
        rows.append(row)
    return rows


# -- measuring -----------------------------------------------------------------------------------
def lmdb_bytes(value_len: int) -> int:
    if value_len <= NODE_MAX:
        return value_len + 8
    return -(-(value_len + 16) // PAGE) * PAGE


REPEATS = 3


def cpu_timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and the CPU time (this thread, user + system) it took.

    CPU time rather than wall time, so that other work on a shared machine counts less; every
    variant runs on this one thread.
    """
    start = time.thread_time()
    out = fn()
    return out, time.thread_time() - start


class Variant:
    """One way to store the data: ``encode() -> blobs`` and ``decode(blobs)``."""

    def __init__(self, name: str, encode: Callable[[], list], decode: Callable[[list], object]) -> None:
        self.name, self.encode, self.decode = name, encode, decode
        self.sizes: list[int] = []
        self.enc = self.dec = float("inf")

    def run(self) -> None:
        blobs, enc = cpu_timed(self.encode)
        _, dec = cpu_timed(lambda: self.decode(blobs))
        self.sizes = [len(b) for b in blobs]
        self.enc, self.dec = min(self.enc, enc), min(self.dec, dec)


def raw_variant(groups) -> Variant:
    specs = [(a.dtype, a.shape) for g in groups for a in g.values()]

    def load(blobs):
        return [np.frombuffer(b, d).reshape(s).copy() for b, (d, s) in zip(blobs, specs, strict=True)]

    return Variant("raw (padded tensors, tobytes)",
                   lambda: [a.tobytes() for g in groups for a in g.values()], load)


def torch_variant(groups) -> Variant:
    tensors = [{k: torch.from_numpy(v) for k, v in g.items()} for g in groups]

    def save():
        out = []
        for g in tensors:
            buf = io.BytesIO()
            torch.save(g, buf)
            out.append(buf.getvalue())
        return out

    return Variant("torch.save (padded, per group)", save,
                   lambda blobs: [torch.load(io.BytesIO(b), weights_only=True) for b in blobs])


def kvckpt_variant(name: str, rows, level: int) -> Variant:
    return Variant(name, lambda: [codec.encode(r, {"group_id": "g", "i": 0}, level=level) for r in rows],
                   lambda blobs: [codec.decode(b) for b in blobs])


def field_sizes(groups, jagged_rows, level):
    """Per token field: padded bytes, unpadded bytes, stored bytes (transforms + zstd, no header)."""
    cctx = zstandard.ZstdCompressor(level=level)
    out = {}
    for name in TOKEN_FIELDS:
        padded = sum(g[name].nbytes for g in groups)
        unpadded = stored = plain = 0
        transforms = None
        for row in jagged_rows:
            arr, dtype = codec.as_numpy(row[name])
            transforms, data = codec.encode_field(arr, dtype, True)
            unpadded += arr.nbytes
            stored += len(cctx.compress(data))
            plain += len(cctx.compress(arr.tobytes()))
        out[name] = (padded, unpadded, stored, plain, transforms)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 MB of data, under 5 s")
    parser.add_argument("--mb", type=float, default=None, help="padded tensor MB (default 200, quick 3)")
    parser.add_argument("--levels", default="1,3", help="zstd levels to measure besides 0 (default 1,3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="best of N timings (default 3, quick 2)")
    args = parser.parse_args(argv)
    global REPEATS
    REPEATS = max(1, args.repeats or (2 if args.quick else 3))
    mb = args.mb if args.mb is not None else (3 if args.quick else 200)
    levels = [0, *[int(x) for x in args.levels.split(",") if x.strip()]]

    start = time.perf_counter()
    groups = list(iter_groups(int(mb * 1e6), args.seed))
    jagged = [r for g in groups for r in rows_of(g, jagged=True)]
    padded = [r for g in groups for r in rows_of(g, jagged=False)]
    raw = sum(a.nbytes for g in groups for a in g.values())
    unpadded = sum(np.asarray(v).nbytes for r in jagged for v in r.values())
    gen_s = time.perf_counter() - start
    codec.decode(codec.encode(jagged[0]))  # warm up (imports, allocators)

    variants = [raw_variant(groups), torch_variant(groups)]
    variants += [kvckpt_variant(f"kvckpt level {lv}, jagged rows", jagged, lv) for lv in levels]
    variants += [kvckpt_variant(f"kvckpt level {lv}, padded rows", padded, lv) for lv in levels]
    for _ in range(REPEATS):  # round robin, keeping each variant's best: drift hits all alike
        for variant in variants:
            variant.run()

    print(f"# codec benchmark: {len(groups)} groups x {GROUP} rows, raw {raw / 1e6:.1f} MB padded, "
          f"{unpadded / 1e6:.1f} MB unpadded ({100 * (1 - unpadded / raw):.0f}% padding); "
          f"{platform.machine()}, {torch.get_num_threads()} torch threads, zstandard "
          f"{zstandard.__version__}; data built in {gen_s:.1f} s\n")
    print("| variant | stored MB | stored / raw | raw / stored | LMDB pages / raw | encode MB/s | decode MB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        stored = sum(v.sizes)
        pages = sum(lmdb_bytes(s) for s in v.sizes)
        print(f"| {v.name} | {stored / 1e6:.1f} | {stored / raw:.3f} | {raw / stored:.1f}x | {pages / raw:.3f} "
              f"| {raw / 1e6 / v.enc:,.0f} | {raw / 1e6 / v.dec:,.0f} |")
    print(f"\nMB/s are MB of raw padded tensors per CPU second (one thread), best of {REPEATS}.\n")

    print("Per token field, jagged rows, zstd level 1 (field bytes only, no record header):\n")
    print("| field | raw padded MB | unpadded MB | stored MB | raw / stored | unpadded / stored "
          "| unpadded / stored without transforms | transforms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, (pad, unpad, stored, plain, transforms) in field_sizes(groups, jagged, 1).items():
        print(f"| {name} | {pad / 1e6:.1f} | {unpad / 1e6:.1f} | {stored / 1e6:.2f} | {pad / stored:.1f}x "
              f"| {unpad / stored:.2f}x | {unpad / plain:.2f}x | {' + '.join(transforms) or '-'} |")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
