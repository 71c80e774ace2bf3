"""The crash path (``ReplayBuffer.open`` + ``recover()``) proves the live file instead of looking
every key up, takes the row keys from the proof instead of iterating the rows, and falls back to
the lookups and the iteration when the proof fails; ``restore(trusted=True)`` checks its copy the
same way (no structure check before liblmdb maps it), the default restore proves the copy first.

Each recovery runs in a fresh interpreter (a restarted trainer) that counts, through three seams,
how often the structure proof (``structure._Check.run``, behind ``is_sound`` and ``proven_keys``),
the key lookups (``verify._check_lookups``) and an iteration of the rows' keys
(``Txn.iter_keys("rows", ...)``) run; nothing is mocked, each still does its work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _crafted import _branch_child_self, _overflow_header_pages
from _damage import raise_rows_separators

from kvckpt import Prompt, ReplayBuffer
from kvckpt.durability.structure import is_sound, proven_keys
from kvckpt.storage import keys
from kvckpt.storage.store import Store
from kvckpt.testing.campaigns.workload import make_row, workload_config

_COUNTING = """
import json, sys
from kvckpt.durability import structure, verify
from kvckpt.storage.txn import Txn
calls = {"proof": 0, "lookups": 0, "row_iterations": 0}

def counted(name, fn, when=lambda *args: True):
    def wrapper(*args, **kwargs):
        calls[name] += when(*args)
        return fn(*args, **kwargs)
    return wrapper

structure._Check.run = counted("proof", structure._Check.run)
verify._check_lookups = counted("lookups", verify._check_lookups)
Txn.iter_keys = counted("row_iterations", Txn.iter_keys, lambda txn, table, prefix: table == "rows")
"""


def _fresh(code: str, **kwargs: Any) -> dict[str, Any]:
    """Run ``code`` after the counting seams in a fresh interpreter (``ARGS`` holds ``kwargs``);
    returns the JSON of its last stdout line, with ``calls`` added."""
    script = _COUNTING + "ARGS = json.loads(sys.argv[1])\nout = {}\n" + textwrap.dedent(code) + \
        "\nprint(json.dumps({**out, 'calls': calls}))\n"
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture
def live(tmp_path: Path) -> Path:
    """A closed live store as a crashed trainer leaves it: 280 groups committed (rows of up to 900
    tokens: large values in overflow runs), 20 in flight, and a checkpoint file of it
    (``ckpt.kvckpt``) beside it."""
    path = tmp_path / "live.kv"
    buf = ReplayBuffer.create(str(path), workload_config({"name": "windowed"}, capacity=400))
    try:
        for lease in buf.admit([Prompt(i) for i in range(300)])[:280]:
            buf.commit_group(lease, [make_row(lease.group_id, i, 900) for i in range(lease.group_size)])
        buf.checkpoint(str(tmp_path / "ckpt.kvckpt"), background=False).wait()
    finally:
        buf.close()
    return path


_RECOVER = """
from kvckpt import ReplayBuffer, VerificationFailed
buf = ReplayBuffer.open(ARGS["path"])
try:
    plan = buf.recover()
    out.update(redispatched=plan.groups_redispatched, ready=plan.groups_complete_restored,
               timings=sorted(plan.timings))
except VerificationFailed as exc:
    out.update(error=str(exc), codes=sorted({p.code for p in exc.problems}))
finally:
    buf.close()
"""


def test_the_crash_path_proves_the_live_file_and_skips_the_lookups(live: Path) -> None:
    out = _fresh(_RECOVER, path=str(live))
    assert out["calls"] == {"proof": 1, "lookups": 0, "row_iterations": 0}, out
    assert (out["redispatched"], out["ready"]) == (20, 280)
    assert {"structure", "validate", "recover"} <= set(out["timings"])


def test_a_live_file_the_proof_refuses_is_looked_up_and_refused(live: Path) -> None:
    """A raised separator key in the rows tree's branch pages: iteration still finds every row,
    lookups miss some. The proof does not accept the file, so recovery looks every key up and
    refuses the store, naming the rows, and writes nothing."""
    raise_rows_separators(live)
    assert not is_sound(live, headers=False)
    before = live.read_bytes()
    out = _fresh(_RECOVER, path=str(live))
    assert out["calls"] == {"proof": 1, "lookups": 1, "row_iterations": 2}, out  # lookups' and check's
    assert out["codes"] == ["unreachable"] and "rows/" in out["error"], out
    assert live.read_bytes() == before


@pytest.mark.parametrize(("trusted", "calls"), [(False, {"proof": 1, "lookups": 0, "row_iterations": 0}),
                                                (True, {"proof": 1, "lookups": 0, "row_iterations": 0})])
def test_restore_takes_the_row_keys_of_its_proof_and_trusted_proves_only_inside_recovery(
        live: Path, trusted: bool, calls: dict[str, int]) -> None:
    out = _fresh("""
        from kvckpt import restore
        buf, plan = restore(ARGS["ckpt"], ARGS["dest"], trusted=ARGS["trusted"])
        out.update(groups=len(buf.groups()), redispatched=plan.groups_redispatched)
        buf.close()
    """, ckpt=str(live.parent / "ckpt.kvckpt"), dest=str(live.parent / "restored.kv"), trusted=trusted)
    assert out["calls"] == calls, out
    assert (out["redispatched"], out["groups"]) == (20, 280)


def test_the_crash_paths_proof_reads_everything_but_the_overflow_headers(live: Path) -> None:
    """``is_sound(headers=False)`` (the crash path's proof) leaves out exactly the header of each
    overflow run's first page, which neither a lookup nor an iteration of keys reads."""
    ckpt = live.parent / "ckpt.kvckpt"
    assert is_sound(ckpt) and is_sound(ckpt, headers=False)
    _overflow_header_pages(str(ckpt))
    assert not is_sound(ckpt)
    assert is_sound(ckpt, headers=False)


def test_the_proofs_row_keys_are_what_iteration_finds(live: Path) -> None:
    with Store(str(live)) as store:
        iterated = store.read(lambda txn: list(txn.iter_keys("rows", b"")))
    proven = proven_keys(live, b"r", headers=False)
    assert proven is not None and len(proven) == 280 * 4
    assert [key[1:] for key in proven] == iterated
    assert proven_keys(live, b"r") == proven
    with Store(str(live)) as store:  # the file a writable handle has open, through its descriptor
        assert proven_keys(store.data_fd(), b"r", headers=False) == proven
        assert proven_keys(store.data_fd(), b"r", headers=False) == proven  # and left open
    assert proven_keys(live, None) == [] and proven_keys(live.parent / "missing.kv", b"r") is None


def test_a_row_missing_from_the_live_store_is_refused_through_the_proofs_keys(live: Path) -> None:
    """A row deleted behind the buffer's back (the file stays sound, so the proof holds and its
    keys are what the verifier checks): recovery refuses the store, naming the group."""
    with Store(str(live)) as store:
        group = store.read(lambda txn: next(iter(txn.iter_keys("groups", b""))))
        store.write(lambda txn: txn.delete("rows", keys.row_key(group.decode(), 2)))
    out = _fresh(_RECOVER, path=str(live))
    assert out["calls"] == {"proof": 1, "lookups": 0, "row_iterations": 0}, out
    assert out["codes"] == ["row-set"] and group.decode() in out["error"], out


def test_the_crash_path_proves_the_file_the_store_has_open_not_what_its_path_names_now(live: Path) -> None:
    """The live file's rows tree is damaged (lookups miss rows, as above); after the trainer opened
    it, an intact copy of it is renamed over its path. The proof must read the file the handle has
    open, not re-open the path: proving the renamed copy would accept its tree, skip the lookups and
    recover the damaged file as sound."""
    intact = live.parent / "intact.kv"
    intact.write_bytes(live.read_bytes())
    raise_rows_separators(live)
    out = _fresh("""
        import os
        from kvckpt import ReplayBuffer, VerificationFailed
        buf = ReplayBuffer.open(ARGS["path"])
        os.replace(ARGS["intact"], ARGS["path"])  # another file takes the path while the store is open
        try:
            plan = buf.recover()
            out.update(redispatched=plan.groups_redispatched)
        except VerificationFailed as exc:
            out.update(error=str(exc), codes=sorted({p.code for p in exc.problems}))
        finally:
            buf.close()
    """, path=str(live), intact=str(intact))
    assert out["calls"] == {"proof": 1, "lookups": 1, "row_iterations": 2}, out
    assert out["codes"] == ["unreachable"] and "rows/" in out["error"], out


def test_a_branch_page_naming_itself_is_a_format_error_where_liblmdb_maps_the_file_unproven(live: Path) -> None:
    """The crash path and ``restore(trusted=True)`` let liblmdb map the file before any structure
    check; a branch page that is its own child sends a lookup down until liblmdb's cursor stack is
    full (``MDB_CURSOR_FULL``). That must say the file is damaged (``FormatError``), like the
    default restore's proof does, never a generic error."""
    ckpt = live.parent / "ckpt.kvckpt"
    _branch_child_self(str(live))
    _branch_child_self(str(ckpt))
    out = _fresh("""
        from kvckpt import ReplayBuffer, restore
        def outcome(fn):
            try:
                fn()
                return "accepted"
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
        def crash_path():
            with ReplayBuffer.open(ARGS["path"]) as buf:
                buf.recover()
        out["crash path"] = outcome(crash_path)
        for trusted in (False, True):
            out[f"restore trusted={trusted}"] = outcome(
                lambda: restore(ARGS["ckpt"], ARGS["dest"] + str(trusted), trusted=trusted)[0].close())
    """, path=str(live), ckpt=str(ckpt), dest=str(live.parent / "restored"))
    del out["calls"]
    assert all(v.startswith("FormatError: ") for v in out.values()), out
    assert "MDB_CURSOR_FULL" in out["crash path"] and "damaged" in out["crash path"], out
