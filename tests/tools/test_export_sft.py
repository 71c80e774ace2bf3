"""Export for SFT: the warnings of an empty or dropped selection (exit 1 with --strict), the SFT
layout's prompt/completion split and provenance, and --decode without special tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvckpt.tools.export import export

from kvckpt import BufferConfig, ReplayBuffer

SCHEMA = {"input_ids": ("int64", "token"), "token_mask": ("int64", "token"), "total_reward": ("float32", "row")}
PROMPT, COMPLETION = [5, 6, 7], [8, 9]


def _rows(reward: float) -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor(PROMPT + COMPLETION)
    mask = torch.tensor([0] * len(PROMPT) + [1] * len(COMPLETION))
    return [{"input_ids": ids, "token_mask": mask, "total_reward": torch.tensor(reward)} for _ in range(2)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Four steps trained, a checkpoint after each: ``live`` has dropped the rows of steps 0-1
    (two later checkpoints cover them); ``kept`` is the same run with ``retain_consumed``."""
    base = tmp_path_factory.mktemp("sft")
    out = {}
    for name, retain in (("live", False), ("kept", True)):
        buf = ReplayBuffer.create(str(base / name / "buffer.kv"), BufferConfig(
            group_size=2, schema=SCHEMA, sampler={"name": "in_order", "max_lookahead_versions": 0},
            max_buffered_rollouts=1, groups_per_step=1, retain_consumed=retain, durable_checkpoints=2))
        for step in range(4):
            [lease] = buf.admit([step], dataloader_state=str(step + 1).encode())
            buf.commit_group(lease, _rows(float(step)))
            buf.select(1, 1)
            buf.finish_step()
            buf.checkpoint(str(base / name / f"step_{step + 1}.kvckpt"), {"step": step + 1}).wait()
        out[name], out[f"{name}_store_id"] = str(base / name / "buffer.kv"), buf.store.store_id
        buf.close()
    return out


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_dropped_range_warns_and_exports_nothing(stores: dict[str, str], tmp_path: Path) -> None:
    result = export(stores["live"], str(tmp_path / "early.jsonl"), fmt="jsonl", steps=(0, 2))
    assert (result.rows, result.groups, result.groups_without_rows) == (0, 0, 2)
    assert len(result.warnings) == 2
    assert "2 group(s) matching state ready,claimed,consumed and steps 0:2 have no rows" in result.warnings[0]
    assert "retain_consumed=True" in result.warnings[0]
    assert result.warnings[1].startswith("nothing exported")
    late = export(stores["live"], str(tmp_path / "late.jsonl"), fmt="jsonl", steps=(2, None))
    assert (late.rows, late.groups_without_rows, late.warnings) == (4, 0, [])


def test_retain_consumed_keeps_every_step(stores: dict[str, str], tmp_path: Path) -> None:
    result = export(stores["kept"], str(tmp_path / "all.jsonl"), fmt="jsonl", steps=(0, 2))
    assert (result.rows, result.groups_without_rows, result.warnings) == (4, 0, [])


def test_cli_strict_exits_1_on_a_warning_and_names_it(stores: dict[str, str], tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvckpt.tools.cli", "export", stores["live"]]
    loose = subprocess.run([*cmd, str(tmp_path / "a.jsonl"), "--format", "jsonl", "--steps", "0:2"],
                           capture_output=True, text=True)
    assert loose.returncode == 0 and "kvckpt export: warning: nothing exported" in loose.stderr
    strict = subprocess.run([*cmd, str(tmp_path / "b.jsonl"), "--format", "jsonl", "--steps", "0:2", "--strict"],
                            capture_output=True, text=True)
    assert strict.returncode == 1 and "have no rows" in strict.stderr
    fine = subprocess.run([*cmd, str(tmp_path / "c.jsonl"), "--format", "jsonl", "--steps", "2:", "--strict"],
                          capture_output=True, text=True)
    assert fine.returncode == 0 and "warning" not in fine.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_sft_layout_splits_prompt_and_completion_with_provenance(stores: dict[str, str], tmp_path: Path,
                                                                 fmt: str) -> None:
    out = tmp_path / f"sft.{fmt}"
    export(stores["kept"], str(out), fmt=fmt, sft=True, fields=["total_reward"])
    rows = pytest.importorskip("pyarrow.parquet").read_table(out).to_pylist() if fmt == "parquet" else _lines(out)
    assert len(rows) == 8
    for row in rows:
        assert row["store_id"] == stores["kept_store_id"]
        assert (row["prompt_ids"], row["completion_ids"]) == (PROMPT, COMPLETION)
        assert row["total_reward"] == float(row["prompt_idx"])  # the reward of that group, per the fixture
        assert row["start_weight"] == row["end_weight"] == row["consumed_step"] == row["prompt_idx"]


def test_sft_needs_the_split_fields(stores: dict[str, str], tmp_path: Path) -> None:
    from kvckpt.errors import BadArgument

    with pytest.raises(BadArgument, match="completion mask"):
        export(stores["kept"], str(tmp_path / "x.jsonl"), fmt="jsonl", sft=True, completion_mask="loss_mask")


def test_decode_skips_special_tokens(stores: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, 16)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(tmp_path / "tok")
    out = tmp_path / "text.jsonl"
    export(stores["kept"], str(out), fmt="jsonl", sft=True, tokenizer=str(tmp_path / "tok"), fields=["input_ids"])
    row = _lines(out)[0]
    assert row["text"] == "w5 w6 w7 w8 w9" and (row["prompt"], row["completion"]) == ("w5 w6 w7", "w8 w9")
    eos_store = tmp_path / "eos.kv"  # a completion ending with end-of-text: no text column shows it
    buf = ReplayBuffer.create(str(eos_store), BufferConfig(group_size=1, schema=SCHEMA, max_buffered_rollouts=2))
    [lease] = buf.admit([0])
    buf.commit_group(lease, [{"input_ids": torch.tensor([5, 8, 0]), "token_mask": torch.tensor([0, 1, 1]),
                              "total_reward": torch.tensor(1.0)}])
    buf.close()
    export(str(eos_store), str(tmp_path / "eos.jsonl"), fmt="jsonl", sft=True, tokenizer=str(tmp_path / "tok"))
    row = _lines(tmp_path / "eos.jsonl")[0]
    assert row["completion_ids"] == [8, 0] and row["completion"] == "w8" and row["text"] == "w5 w8"
