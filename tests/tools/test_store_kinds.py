"""The store kinds are registered once (kvckpt.durability.kinds): verify and the tools dispatch on the
registry, so a third kind is one registration, and a kind without a tool's hook is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvckpt.tools.compact import compact
from kvckpt.tools.export import export
from kvckpt.tools.inspect import inspect_path

from kvckpt import BadArgument, verify_path
from kvckpt.durability import kinds
from kvckpt.storage.store import Store

TOY_KEY = b"toy"


def _verify(txn: Any, report: Any, options: kinds.VerifyOptions) -> None:
    doc = txn.get_json("meta", TOY_KEY)
    report.counts["toys"] = doc["toys"]
    if doc["toys"] < 0:
        report.add("negative-toys", "meta/toy", "a toy store cannot hold fewer than no toys")


def _inspect(txn: Any, ledger_limit: int, progress: Any) -> dict[str, Any]:
    return {"problems": [], "toys": txn.get_json("meta", TOY_KEY)["toys"], "bytes": {}}


def _compact(store: Store, level: int, result: Any, progress: Any) -> None:
    def double(txn: Any) -> None:
        txn.put_json("meta", TOY_KEY, {"toys": txn.get_json("meta", TOY_KEY)["toys"] * 2})

    store.write(double)
    result.rows_reencoded = level


def _export(txn: Any, path: str, job: Any) -> Any:
    from kvckpt.tools.export import ExportResult

    with open(job.tmp, "w") as out:
        json.dump(txn.get_json("meta", TOY_KEY), out)
    return ExportResult(job.out, job.fmt, ["toys"], rows=1)


@pytest.fixture
def toy_kind() -> Iterator[kinds.StoreKind]:
    kind = kinds.register(kinds.StoreKind("toy", "a toy store", lambda txn: txn.get("meta", TOY_KEY) is not None,
                                          _verify, _inspect, _compact, _export))
    yield kind
    kinds.unregister("toy")


def _toy(path: Path, toys: int) -> str:
    with Store(str(path), create=True) as store:
        store.write(lambda txn: txn.put_json("meta", TOY_KEY, {"toys": toys}))
    return str(path)


def test_a_third_kind_is_one_registration(tmp_path: Path, toy_kind: kinds.StoreKind) -> None:
    toy = _toy(tmp_path / "toy.kv", 3)
    report = verify_path(toy)
    assert report.ok and report.counts["toys"] == 3
    assert not verify_path(_toy(tmp_path / "bad.kv", -1)).ok
    doc = inspect_path(toy)
    assert doc["kind"] == "toy" and doc["toys"] == 3
    result = compact(toy, str(tmp_path / "small.kv"), level=5)
    assert result.rows_reencoded == 5 and inspect_path(str(tmp_path / "small.kv"))["toys"] == 6
    assert export(toy, str(tmp_path / "toy.jsonl"), fmt="jsonl").rows == 1
    assert json.loads((tmp_path / "toy.jsonl").read_text()) == {"toys": 3}


def test_a_kind_without_a_tools_hook_is_refused_by_name(tmp_path: Path, toy_kind: kinds.StoreKind) -> None:
    kinds.register(kinds.StoreKind("toy", "a toy store", toy_kind.marked, _verify))
    toy = _toy(tmp_path / "toy.kv", 1)
    with pytest.raises(BadArgument, match="is a toy store: `kvckpt export` does not read a 'toy' store"):
        export(toy, str(tmp_path / "toy.jsonl"), fmt="jsonl")
    with pytest.raises(BadArgument, match="`kvckpt compact` does not read a 'toy' store"):
        compact(toy, str(tmp_path / "small.kv"), level=1)
    assert not (tmp_path / "toy.jsonl").exists() and not (tmp_path / "small.kv").exists()


def test_the_built_in_kinds_are_registered_with_every_hook() -> None:
    registered = {kind.name: kind for kind in kinds.kinds()}
    assert {"replay-buffer", "values"} <= set(registered)
    assert all(registered["replay-buffer"].hook(tool, "x") for tool in kinds.TOOL_HOOKS)
    assert registered["values"].inspect and registered["values"].compact and registered["values"].export is None
