"""The ``kvckpt`` command line, end to end through the installed console script.

Every store here is made by the library in this process and closed (or, for the live-store test,
held open by this process as the writer); every command runs in a subprocess exactly as a user
runs it. Read-only commands must leave their inputs byte-identical and create no lock file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _cli import kv
from kvckpt.tools.cli import main

from kvckpt import BufferConfig, Prompt, ReplayBuffer
from kvckpt.storage import codec, keys
from kvckpt.storage.store import FORMAT_VERSION, Store

SCHEMA = {"input_ids": ("int64", "token"), "generation_logprobs": ("float32", "token"),
          "ref_logprobs": ("bfloat16", "token"), "token_mask": ("bool", "token"),
          "total_reward": ("float32", "row"), "prompt_shape": ("int32", "row")}


def kv_json(*args: str, check: int = 0) -> dict:
    return json.loads(kv(*args, "--json", check=check).stdout)


def make_row(rng: np.random.Generator, length: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.from_numpy(rng.integers(0, 50_000, length)),
            "generation_logprobs": torch.from_numpy(-rng.random(length, dtype=np.float32)),
            "ref_logprobs": torch.from_numpy(-rng.random(length, dtype=np.float32)).to(torch.bfloat16),
            "token_mask": torch.from_numpy(rng.random(length) > 0.3),
            "total_reward": torch.tensor(float(rng.random()), dtype=torch.float32),
            "prompt_shape": torch.tensor([length, 3], dtype=torch.int32)}


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A closed store after 4 steps (consumed rows retained), one ready group, 2 in flight (one with a
    finished sibling), plus checkpoints at steps 2 and 4. Afterwards: the files are unchanged."""
    d = tmp_path_factory.mktemp("cli")
    path = str(d / "live.kv")
    rng = np.random.default_rng(7)
    buf = ReplayBuffer.create(path, BufferConfig(
        group_size=2, schema=SCHEMA, sampler={"name": "in_order", "max_lookahead_versions": 2},
        max_buffered_rollouts=9, groups_per_step=3, retain_consumed=True))
    for step in range(4):
        leases = buf.admit([Prompt(step * 3 + j, "math" if j % 2 else "code") for j in range(3)],
                           dataloader_state=f"next={step * 3 + 3}".encode())
        for lease in leases:
            buf.commit_group(lease, [make_row(rng, int(rng.integers(5, 60))) for _ in range(2)])
        buf.read_batch(buf.select())
        buf.finish_step()
        if step in (1, 3):
            buf.checkpoint(str(d / f"step{step + 1}.kvckpt"), {"step": step + 1}).wait()
    leases = buf.admit([Prompt(100 + j) for j in range(3)], dataloader_state=b"next=15")
    buf.commit_group(leases[0], [make_row(rng, 9), make_row(rng, 11)])
    buf.commit_sample(leases[1], 1, make_row(rng, 4))
    for index, start, length in ((0, 0, 5), (0, 5, 3), (1, 0, 2)):  # two samples of leases[2] generating
        buf.record_progress(leases[2], index, start=start, tokens=torch.arange(start, start + length),
                            logprobs=-torch.rand(length), weight_version=4)
    buf.close()
    os.unlink(path + "-lock")
    before = {name: digest(str(d / name)) for name in os.listdir(d)}
    yield {"dir": d, "live": path, "ck2": str(d / "step2.kvckpt"), "ck4": str(d / "step4.kvckpt")}
    # Every command of this module read these files: not one byte changed, and no lock file (or any
    # other file) appeared next to them.
    assert {name: digest(str(d / name)) for name in os.listdir(d)} == before


@pytest.fixture(scope="module")
def churned(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store that went through many steps whose groups were consumed (rows dropped) or evicted:
    most of its pages are free."""
    d = tmp_path_factory.mktemp("churn")
    path = str(d / "churn.kv")
    rng = np.random.default_rng(1)
    buf = ReplayBuffer.create(path, BufferConfig(
        group_size=4, schema={"input_ids": ("int64", "token"), "logprobs": ("float32", "token")},
        sampler={"name": "windowed", "max_staleness_versions": 0}, max_buffered_rollouts=16, groups_per_step=4,
        durable_checkpoints=1, compression_level=0))
    for step in range(12):
        for lease in buf.admit(list(range(step * 8, step * 8 + 8))):
            buf.commit_group(lease, [{"input_ids": torch.from_numpy(rng.integers(0, 9, 2000)),
                                      "logprobs": torch.from_numpy(rng.random(2000, dtype=np.float32))}
                                     for _ in range(4)])
        buf.select(4, 4)
        buf.finish_step()
        buf.evict()
        buf.checkpoint(str(d / "ck.kvckpt"), overwrite=True, background=False)
    buf.finish_step()  # two more empty steps and a checkpoint: the last consumed rows are dropped too
    buf.checkpoint(str(d / "ck.kvckpt"), overwrite=True, background=False)
    buf.finish_step()
    for lease in buf.admit([1000, 1001]):
        buf.commit_group(lease, [{"input_ids": torch.arange(10), "logprobs": torch.zeros(10)}] * 4)
    buf.close()
    os.unlink(path + "-lock")
    return path


# -- help and usage ------------------------------------------------------------------------------
def test_help_lists_every_command_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    out = kv("--help").stdout
    assert ("Exit status: 0 ok, 1 problems or differences found (a damaged or foreign file too), 2 usage or I/O "
            "error.") in " ".join(out.split())
    assert "--deep" in kv("verify", "--help").stdout
    for name in ("inspect", "verify", "compact", "export", "diff", "demo"):
        assert f"\n    {name} " in out
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"example: kvckpt {name} " in " ".join(capsys.readouterr().out.split())


def test_python_dash_m_runs_the_same_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvckpt.tools.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("kvckpt ")


@pytest.mark.parametrize(("args", "message"), [
    ((), "the following arguments are required: COMMAND"),
    (("export", "{live}", "{dir}/o", "--format", "csv"), "argument --format: invalid choice: 'csv'"),
    (("compact", "{live}", "{dir}/o", "--level", "30"), "argument --level: must be an integer from 0 to 22, got 30"),
    (("export", "{live}", "{dir}/o", "--format", "jsonl", "--steps", "7"), "--steps must look like A:B"),
    (("export", "{live}", "{dir}/o", "--format", "jsonl", "--fields", "input_ids,nope"), "unknown field(s) nope"),
    (("export", "{live}", "{dir}/o", "--format", "jsonl", "--state", "done"), "unknown state(s) done"),
    (("inspect", "{dir}/missing.kv"), "no such file: "),
    (("diff", "{live}", "{dir}"), "is not a file"),
    (("compact", "{live}", "{ck2}"), "already exists; pass --force"),
    (("compact", "{live}", "{live}", "--force"), "is the input itself"),
])
def test_usage_errors_exit_2_with_one_line(store: dict, args: tuple[str, ...], message: str) -> None:
    proc = kv(*(a.format(**store) for a in args), check=2)
    assert message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_not_a_store_is_a_problem_with_one_exit_status_from_every_verb(tmp_path) -> None:
    """Issue 18 item 7: verify said 1 and inspect 2 on the same foreign file; now every verb that
    reads it says 1 (a problem with the file) in one line naming it."""
    junk = tmp_path / "junk.kv"
    junk.write_bytes(b"hello")
    proc = kv("inspect", junk, check=1)
    assert "truncated, or not a kvckpt store" in proc.stderr and proc.stderr.count("\n") == 1
    assert "truncated, or not a kvckpt store" in kv("verify", junk, check=1).stdout
    for args in (("export", junk, tmp_path / "o.jsonl", "--format", "jsonl"), ("diff", junk, junk),
                 ("compact", junk, tmp_path / "o.kv")):
        proc = kv(*args, check=1)
        assert "not a kvckpt store" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_says_when_compression_made_rows_larger() -> None:
    from kvckpt.tools.cli import _ratio, printable

    assert _ratio(100, 275) == "2.75x larger than raw: these rows are too small to compress"
    assert _ratio(300, 100) == "3.00x smaller than raw"
    assert printable("g\x1b[2J\x07\n") == "g\\x1b[2J\\x07\\x0a"


# -- inspect -------------------------------------------------------------------------------------
def test_inspect_reports_counts_cursors_and_stamp(store: dict) -> None:
    doc = kv_json("inspect", store["live"])
    with Store(store["live"], readonly=True) as s:
        store_id = s.store_id
    assert doc["identity"]["store_id"] == store_id and doc["identity"]["version"] == FORMAT_VERSION
    assert doc["live"] is False and doc["problems"] == []
    assert doc["counts"] == {"inflight": 2, "ready": 1, "claimed": 0, "consumed": 12, "evicted": 0, "aborted": 0,
                             "groups": 13, "rows": 12 * 2 + 2 + 1}
    assert doc["ledger"]["count"] == 2 and doc["ledger"]["partial"] == 1
    assert doc["progress"] == {"samples": 2, "chunks": 3, "tokens": 8 + 2}
    assert [(e["prompt_idx"], e["siblings"]) for e in doc["ledger"]["first"]] == [(101, [1]), (102, [])]
    assert doc["cursors"]["trainer_version"] == 4 and doc["cursors"]["dispatch_index"] == 4
    assert doc["checkpoint"]["trainer_version"] == 4 and doc["checkpoint"]["trainer_state"] == {"step": 4}
    assert doc["config"]["sampler"] == {"name": "in_order", "max_lookahead_versions": 2}
    assert doc["dataloader_state_bytes"] == len(b"next=15")
    assert doc["weights"] == {"held": {"oldest": 0, "newest": 4}, "all": {"oldest": 0, "newest": 4}}
    assert [(r["step"], r["consumed"]) for r in doc["histogram"]["by_step"]][:4] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert doc["histogram"]["by_weight"][-1] == {"weight": 4, "inflight": 2, "ready": 1, "claimed": 0,
                                                 "consumed": 0, "evicted": 0, "aborted": 0}
    buf = ReplayBuffer.open(store["live"], readonly=True)
    try:
        groups = [g for g in buf.groups() if g.rows_stored]
        assert doc["bytes"]["raw"] == sum(g.raw_bytes for g in groups) + sum(e.raw_bytes for e in buf.ledger())
    finally:
        buf.close()
    assert doc["bytes"]["file"] == os.path.getsize(store["live"])


def test_inspect_terminal_report_is_aligned(store: dict) -> None:
    out = kv("inspect", store["ck2"]).stdout
    lines = out.splitlines()
    assert "ledger  0 in flight, 0 with finished siblings" in out
    assert "progress  0 samples generating, 0 chunks, 0 durable tokens" in out
    assert "progress  2 samples generating, 3 chunks, 10 durable tokens" in kv("inspect", store["live"]).stdout
    header = next(i for i, line in enumerate(lines) if line.split() == ["state", "count"])
    table = lines[header + 1:header + 9]
    assert len({len(line) for line in table}) == 1  # right-aligned counts end in one column
    assert table[3].split() == ["consumed", "6"]


def test_inspect_a_store_held_by_a_live_writer(tmp_path) -> None:
    path = str(tmp_path / "held.kv")
    buf = ReplayBuffer.create(path, BufferConfig(group_size=1, schema={"x": ("int64", "token")}))
    try:
        [lease] = buf.admit([5])
        files = sorted(os.listdir(tmp_path))
        doc = kv_json("inspect", path)
        assert doc["live"] is True and doc["counts"]["inflight"] == 1
        buf.commit_group(lease, [{"x": torch.arange(3)}])  # the writer is not blocked by the reader
        assert kv_json("inspect", path)["counts"]["ready"] == 1
        assert sorted(os.listdir(tmp_path)) == files
    finally:
        buf.close()


# -- verify --------------------------------------------------------------------------------------
def test_verify_ok(store: dict) -> None:
    doc = kv_json("verify", store["live"])
    assert doc["ok"] is True and doc["problems"] == [] and doc["counts"]["rows"] == 27
    assert kv("verify", store["ck4"]).stdout.startswith(f"{store['ck4']}: ok")


def test_verify_catches_a_flipped_byte_in_a_row(tmp_path) -> None:
    path = str(tmp_path / "plain.kv")
    buf = ReplayBuffer.create(path, BufferConfig(group_size=2, schema={"input_ids": ("int64", "token")},
                                                 sampler="windowed", compression_level=0))
    for i in range(3):
        [lease] = buf.admit([i])
        buf.commit_group(lease, [{"input_ids": torch.arange(1000, 1400) * (i + 1)}, {"input_ids": torch.arange(7)}])
    ckpt = str(tmp_path / "good.kvckpt")
    buf.checkpoint(ckpt).wait()
    buf.close()
    with open(ckpt, "rb") as f:
        data = bytearray(f.read())
    pattern = (np.arange(1000, 1400) * 2).astype("<i8").tobytes()  # row 0 of the second group, stored raw
    offset = data.find(pattern)
    assert offset > 0 and data.find(pattern, offset + 1) == -1
    data[offset + 800] ^= 0xFF
    bad = tmp_path / "bad.kvckpt"
    bad.write_bytes(bytes(data))
    for flags in ([], ["--deep"]):  # the default verify checksums every row; --deep also decodes them
        doc = kv_json("verify", *flags, bad, check=1)
        problems = [(p["code"], p["key"], p["message"]) for p in doc["problems"]]
        assert ("corrupt-record", "rows/a1-p0_g0", "checksum mismatch") in problems
        assert all("a1-p0" in key for _, key, _ in problems)  # only the damaged group is reported
        assert doc["not_checked"]
        text = kv("verify", *flags, bad, check=1).stdout
        assert "problem(s)" in text.splitlines()[0] and "  [corrupt-record] rows/a1-p0_g0: checksum mismatch" in text
        assert text.splitlines()[-1].startswith("  not checked: ")
    proc = kv("export", bad, tmp_path / "x.jsonl", "--format", "jsonl", check=1)
    assert "corrupt record 'rows/a1-p0_g0'" in proc.stderr and not (tmp_path / "x.jsonl").exists()


# -- compact -------------------------------------------------------------------------------------
def test_compact_shrinks_a_churned_store_and_keeps_every_group(churned: str, tmp_path) -> None:
    dest = tmp_path / "small.kv"
    doc = kv_json("compact", churned, dest)
    assert doc["bytes_before"] == os.path.getsize(churned) and doc["bytes_after"] == os.path.getsize(dest)
    assert doc["bytes_after"] * 4 < doc["bytes_before"]
    assert kv_json("diff", churned, dest, "--rows")["same"] is True
    assert kv_json("verify", dest)["ok"] is True
    assert sorted(os.listdir(tmp_path)) == ["small.kv"]  # no partial file, no lock file
    kv("compact", churned, dest, check=2)
    kv("compact", churned, dest, "--force")


def test_compact_reencodes_rows_at_another_level(store: dict, tmp_path) -> None:
    dest = str(tmp_path / "z9.kv")
    doc = kv_json("compact", store["live"], dest, "--level", "9")
    assert doc["level"] == 9 and doc["rows_reencoded"] == 27
    diff = kv_json("diff", store["live"], dest, check=1)
    assert diff["config"] == {"compression_level": [1, 9]} and diff["cursors"] == {}
    assert diff["compared_rows"] is True
    assert diff["groups"]["counts"] == {"added": 0, "removed": 0, "changed": 0, "same": 13}
    assert diff["ledger"]["counts"] == {"added": 0, "removed": 0, "changed": 0, "same": 2}
    assert kv_json("verify", "--deep", dest)["ok"] is True
    with Store(dest, readonly=True) as s:
        value = s.read(lambda t: t.get("rows", keys.row_key("a0-p0", 1)))
    assert codec.decode(value).meta == {"group_id": "a0-p0", "index": 1}
    header_len = int.from_bytes(value[8:12], "little")
    assert json.loads(value[12:12 + header_len])["z"] == 9


# -- export --------------------------------------------------------------------------------------
def stored_rows(path: str) -> dict[tuple[str, int], tuple[dict, dict[str, np.ndarray]]]:
    """(group id, row) -> (group record, decoded arrays), straight from the store."""
    out = {}
    buf = ReplayBuffer.open(path, readonly=True)
    try:
        for group in buf.groups():
            if not group.rows_stored:
                continue
            batch = buf.read_batch([group.group_id], layout="list")
            for index, row in zip(batch.row_indices, batch.rows, strict=True):
                arrays = {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in row.items()}
                out[(group.group_id, index)] = (group.to_dict(), arrays)
    finally:
        buf.close()
    return out


def test_export_parquet_round_trip(store: dict, tmp_path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "rows.parquet"
    doc = kv_json("export", store["ck4"], out, "--format", "parquet", "--batch-mb", "0.01")
    expected = stored_rows(store["ck4"])
    assert pq.ParquetFile(out).num_row_groups > 1  # streamed in several batches
    assert doc["rows"] == len(expected) == 24 and doc["groups"] == 12
    assert doc["raw_bytes"] == sum(a.nbytes for _, arrays in expected.values() for a in arrays.values()
                                   ) - sum(r["ref_logprobs"].size * 2 for _, r in expected.values())
    table = pq.read_table(out)
    assert str(table.schema.field("input_ids").type) == "list<element: int64>"
    assert str(table.schema.field("ref_logprobs").type) == "list<element: float>"
    assert str(table.schema.field("token_mask").type) == "list<element: bool>"
    assert str(table.schema.field("total_reward").type) == "float"
    assert str(table.schema.field("prompt_shape").type) == "list<element: int32>"
    for rec in table.to_pylist():
        group, arrays = expected[(rec["group_id"], rec["row"])]
        for column in ("prompt_idx", "task_name", "state", "start_weight", "end_weight", "target_step",
                       "claimed_step", "consumed_step", "seq"):
            assert rec[column] == group[column]
        for name, arr in arrays.items():
            assert np.array_equal(np.asarray(rec[name], dtype=arr.dtype), arr), name


def test_export_filters_and_jsonl(store: dict, tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    doc = kv_json("export", store["live"], out, "--format", "jsonl", "--state", "consumed,ready",
                  "--steps", "1:3", "--fields", "input_ids,total_reward")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert doc["rows"] == len(lines) == 12 and doc["fields"] == ["input_ids", "total_reward"]
    assert sorted({r["group_id"] for r in lines}) == ["a1-p0", "a1-p1", "a1-p2", "a2-p0", "a2-p1", "a2-p2"]
    assert {r["consumed_step"] for r in lines} == {1, 2}
    assert set(lines[0]) == {"group_id", "row", "prompt_idx", "task_name", "state", "start_weight", "end_weight",
                             "target_step", "claimed_step", "consumed_step", "seq", "input_ids", "total_reward"}
    expected = stored_rows(store["live"])
    for r in lines:
        arrays = expected[(r["group_id"], r["row"])][1]
        assert r["input_ids"] == arrays["input_ids"].tolist() and r["total_reward"] == arrays["total_reward"].item()
    kv("export", store["live"], tmp_path / "ready.jsonl", "--format", "jsonl", "--state", "ready")
    ready = [json.loads(line) for line in (tmp_path / "ready.jsonl").read_text().splitlines()]
    assert [(r["group_id"], r["row"], r["state"]) for r in ready] == [("a4-p0", 0, "ready"), ("a4-p0", 1, "ready")]
    kv("export", store["live"], out, "--format", "jsonl", check=2)  # exists: refused without --force
    assert kv_json("export", store["live"], out, "--format", "jsonl", "--force")["rows"] == 26


def test_export_decode_with_a_local_tokenizer(store: dict, tmp_path) -> None:
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(50_000)}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path / "tok")
    out = tmp_path / "text.jsonl"
    kv("export", store["ck2"], out, "--format", "jsonl", "--fields", "input_ids", "--decode", tmp_path / "tok")
    first = json.loads(out.read_text().splitlines()[0])
    assert first["text"] == " ".join(f"w{i}" for i in first["input_ids"])


# -- diff ----------------------------------------------------------------------------------------
def test_diff_reports_groups_ledger_and_cursors(store: dict) -> None:
    doc = kv_json("diff", store["ck2"], store["live"], check=1)
    assert doc["same"] is False and doc["identity"] == {} and doc["config"] == {}
    assert doc["cursors"]["trainer_version"] == [2, 4] and doc["cursors"]["dataloader_state"] == ["next=6", "next=15"]
    assert doc["groups"]["added"] == ["a2-p0", "a2-p1", "a2-p2", "a3-p0", "a3-p1", "a3-p2", "a4-p0"]
    assert doc["groups"]["counts"] == {"added": 7, "removed": 0, "changed": 0, "same": 6}
    assert doc["ledger"]["added"] == ["a4-p1", "a4-p2"]
    text = kv("diff", store["ck2"], store["live"], check=1).stdout
    assert "groups  7 added, 0 removed, 0 changed, 6 same" in text and text.rstrip().endswith("different")


def test_diff_detects_a_changed_store(store: dict, tmp_path) -> None:
    changed = str(tmp_path / "changed.kv")
    shutil.copyfile(store["live"], changed)
    assert kv_json("diff", store["live"], changed)["same"] is True
    buf = ReplayBuffer.open(changed)
    sel = buf.select()  # claims the ready group for step 4
    buf.abort("a4-p2", "test")
    buf.close()
    doc = kv_json("diff", store["live"], changed, check=1)
    assert doc["groups"]["changed"] == {"a4-p0": {"state": ["ready", "claimed"], "claimed_step": [None, 4]}}
    assert doc["groups"]["added"] == ["a4-p2"] and doc["ledger"]["removed"] == ["a4-p2"]
    assert sel.group_ids == ["a4-p0"] and doc["cursors"]["claimed"] == [0, 1]


# -- demo ----------------------------------------------------------------------------------------
def test_demo_fast_trains_every_prompt_exactly_once() -> None:
    out = " ".join(kv("demo", "--fast", "--no-model").stdout.split())
    assert ("exactly once 48 prompts served: 48 trained once, 0 discarded by the sampler, 0 buffered, 0 lost, "
            "0 doubled") in out
    assert "generation work lost 0 completions: the " in out and "final store verifies clean" in out
    assert "model-free producer/consumer, sampler in_order" in out and "learning curve" not in out
    assert "result: ok" in out


def test_demo_fast_from_a_checkpoint_file(tmp_path) -> None:
    doc = kv_json("demo", "--fast", "--no-model", "--recovery", "checkpoint", "--out", tmp_path / "run")
    check, rec = doc["check"], doc["recovery"]
    assert doc["ok"] is True and check["lost"] == [] and check["doubled"] == [] and check["verify_ok"] is True
    assert check["model_agrees"] is True and check["trained_once"] + check["discarded"] == 48
    assert rec["mode"] == "checkpoint" and rec["work_lost"] == {k: rec["work_after_checkpoint"][k]
                                                                for k in ("groups", "rows", "raw_bytes")}
    assert os.path.exists(tmp_path / "run" / "live.kv") and doc["out"] == str(tmp_path / "run")
