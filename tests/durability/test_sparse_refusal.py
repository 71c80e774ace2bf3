"""The early sparse-file refusal (``check_header``'s hole check), aimed at directly.

The crafted file whose meta pages claim a million pages (4 GiB, all holes but the first pages)
is refused by the structure check too, but only after ``restore`` has copied the holes. Here every
entry point that opens a file (``restore``, ``ReplayBuffer.open(readonly=True)``, each ``kvckpt``
verb that opens one) runs on it in one fresh process whose files may not grow past
:data:`FSIZE_LIMIT`, and must refuse it with the error that names the holes, having written
(``/proc/self/io`` ``wchar``, which counts ``copy_file_range`` too), created and mapped nothing: evidence
that does not depend on timing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import _crafted
import pytest
from _paths import child_env

#: No file the probe process writes may grow past this (a copy of the holes would be 4 GiB);
#: SIGXFSZ is ignored, so such a write fails with EFBIG instead of killing the probe.
FSIZE_LIMIT = 64 << 20
CASE = "meta-claims-1M-pages"
CLI_VERBS = ("inspect", "verify", "verify --deep", "export", "diff", "compact")


def _proc(name: str, field: str) -> int:
    with open(f"/proc/self/{name}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * (1024 if name == "status" else 1)
    raise AssertionError(f"no {field} in /proc/self/{name}")


def _files(*folders: str) -> dict[str, int]:
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_blocks * 512
            for folder in folders for d, _, names in os.walk(folder) for n in names}


def _probe(path: str, base: str, work: str) -> list[dict]:
    """Run every entry point on ``path`` in this process; what each did."""
    from kvckpt.tools.cli import main as cli

    from kvckpt import ReplayBuffer, restore
    from kvckpt.errors import KvckptError

    with contextlib.suppress(ImportError):  # loaded lazily by some verbs: loaded now, VmPeak measures maps
        import torch  # noqa: F401
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    results = []
    for entry in ("restore", "readonly", *CLI_VERBS):
        out = os.path.join(work, entry.replace(" ", "_"))
        os.makedirs(out)
        before = _files(os.path.dirname(path), out)
        wchar, peak = _proc("io", "wchar"), _proc("status", "VmPeak")
        said, status = "", None
        try:
            if entry == "restore":
                restore(path, os.path.join(out, "live.kv"))[0].close()
            elif entry == "readonly":
                ReplayBuffer.open(path, readonly=True).close()
            else:
                verb, *flags = entry.split()
                args = {"export": [path, os.path.join(out, "out.jsonl"), "--format", "jsonl"], "diff": [base, path],
                        "compact": [path, os.path.join(out, "out.kv")]}.get(verb, [path])
                told = io.StringIO()  # verify reports on stdout, the other verbs refuse on stderr
                with contextlib.redirect_stderr(told), contextlib.redirect_stdout(told):
                    status = cli([verb, *flags, *args])
                said = told.getvalue()
        except KvckptError as exc:
            said = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # reported, and judged by the test
            said = f"generic {type(exc).__name__}: {exc}"
        results.append({"entry": entry, "status": status, "said": said[-600:],
                        "written": _proc("io", "wchar") - wchar, "mapped": _proc("status", "VmPeak") - peak,
                        "new_files": sorted(set(_files(os.path.dirname(path), out)) - set(before))})
    return results


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from kvckpt.testing.campaigns.fuzz import build_base

    folder = tmp_path_factory.mktemp("sparse")
    base = str(folder / "base.kvckpt")
    build_base(base, False)
    path = str(folder / "files" / f"{CASE}.kvckpt")
    os.makedirs(os.path.dirname(path))
    shutil.copyfile(base, path)
    [case] = [c for c in _crafted.CASES if c.name == CASE]
    case.build(path)
    assert os.path.getsize(path) == 4 << 30 and os.stat(path).st_blocks * 512 < 1 << 20  # 4 GiB of holes
    return path, base


def test_a_file_claiming_a_million_pages_is_refused_before_anything_copies_or_maps_it(sparse, tmp_path):
    path, base = sparse
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, __file__, path, base, str(work)], capture_output=True, text=True,
                          timeout=600, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert [r["entry"] for r in results] == ["restore", "readonly", *CLI_VERBS]
    late = []
    for r in results:
        if "holes" not in r["said"] or "Nothing was copied" not in r["said"] or r["status"] not in (None, 1):
            late.append(f"{r['entry']}: not the early refusal naming the holes (exit {r['status']}): {r['said']}")
        if r["written"] > 1 << 20 or r["new_files"]:
            late.append(f"{r['entry']}: wrote {r['written']:,} bytes, created {r['new_files']}")
        if r["mapped"] > 1 << 30:
            late.append(f"{r['entry']}: mapped {r['mapped']:,} bytes")
    for r in results:  # pytest -s
        print(f"{r['entry']}: wrote {r['written']} B, VmPeak +{r['mapped']} B: {r['said'][:160]}")
    assert not late, "\n".join(late)
    assert sorted(os.listdir(os.path.dirname(path))) == [os.path.basename(path)]


if __name__ == "__main__":
    print(json.dumps(_probe(*sys.argv[1:4])))
