"""Export: stored rows with their group metadata, to Parquet (analysis, SFT data) or JSONL (a look).

:func:`export` reads **one snapshot** of a store or checkpoint (opened read-only, never modified)
and streams its rows, in group-key order, into ``out`` in batches of about ``batch_bytes`` raw
bytes, so memory stays bounded whatever the store's size. Each output row is one completion:

* metadata columns :data:`META_COLUMNS` (``group_id``, ``row`` = index in the group,
  ``prompt_idx``, ``task_name``, ``state``, ``start_weight``, ``end_weight``, ``target_step``,
  ``claimed_step``, ``consumed_step``, ``seq`` = dispatch order);
* one column per exported field: token fields as ``list<dtype>``, scalar row fields as plain
  columns, row fields with a shape as (nested) lists. ``bfloat16`` is widened to ``float32``
  (exactly), since Parquet has no bfloat16. Text fields are ``string`` (``str``) and ``binary``
  (``bytes``) columns; in JSONL, strings and base64 text;
* ``text`` when a tokenizer is given: ``input_ids`` detokenized, special tokens skipped;
* with ``sft=True`` (``--sft``), the SFT layout on top: ``store_id`` (provenance, with
  ``group_id``, the weight versions and the reward fields already there), ``prompt_ids`` and
  ``completion_ids`` — ``input_ids`` split at the first non-zero position of the completion mask
  field (``token_mask`` by default: 1 on generated tokens) — and, with a tokenizer, ``prompt`` and
  ``completion`` texts.

Groups the selection names but whose rows are gone (consumed rows dropped once enough later
checkpoints covered their step, unless ``retain_consumed``; evicted and aborted groups) are
counted in :attr:`ExportResult.groups_without_rows`, and :attr:`ExportResult.warnings` says so,
as it does for a selection that matched no rows at all (``kvckpt export --strict`` then exits 1).

Parquet files are written with ``pyarrow.parquet.ParquetWriter`` (zstd), one row group per batch.
JSONL writes one object per line; non-finite floats appear as ``NaN``/``Infinity``/``-Infinity``
(what Python's ``json`` reads back).

The output is written under a temporary ``.partial`` name, fsynced and renamed: ``out`` is
complete or absent. Exporting a live store holds its read snapshot for the whole export; LMDB
cannot reuse pages the writer frees meanwhile, so export a checkpoint when the store is large and
busy.

The module is long (about 540 lines) because the two formats share one bounded-memory pipeline
(snapshot reader, batcher, column builders, the SFT split and the durable rename); each part is
only meaningful with the others.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvckpt.tools.compact import check_destination
from kvckpt.tools.inspect import Progress

from kvckpt import CLAIMED, CONSUMED, READY, RowSchema, codec, durable_replace
from kvckpt.errors import BadArgument, CorruptRecord, InvariantViolation, SchemaMismatch
from kvckpt.tooling import CONFIG_KEY, GROUP_STATES, check_group_digest, keys, kinds, open_readonly

FORMATS = ("parquet", "jsonl")
META_COLUMNS = ("group_id", "row", "prompt_idx", "task_name", "state", "start_weight", "end_weight",
                "target_step", "claimed_step", "consumed_step", "seq")
TEXT_COLUMN = "text"
#: The SFT layout's extra columns (token ids, then texts when a tokenizer is given).
SFT_COLUMNS = ("store_id", "prompt_ids", "completion_ids")
SFT_TEXT_COLUMNS = ("prompt", "completion")
DEFAULT_COMPLETION_MASK = "token_mask"
#: States whose groups hold rows (the default selection).
STATES_WITH_ROWS = (READY, CLAIMED, CONSUMED)
DEFAULT_BATCH_BYTES = 32 << 20


@dataclass
class ExportResult:
    """What :func:`export` wrote: counts, raw row bytes exported, the file's size, seconds, and
    ``warnings`` (an empty selection, or ``groups_without_rows`` groups it named whose rows are gone)."""

    path: str
    format: str
    fields: list[str]
    groups: int = 0
    rows: int = 0
    raw_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0
    groups_without_rows: int = 0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``kvckpt export --json``)."""
        return dict(self.__dict__)


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """Parse ``A:B`` (either end may be empty) into a half-open step range ``[A, B)``.

    Raises:
        BadArgument: not of the form ``A:B`` with integers.
    """
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise BadArgument(f"--steps must look like A:B (half-open, either end optional), got {text!r}") from None
    if bounds[0] is not None and bounds[1] is not None and bounds[1] <= bounds[0]:
        raise BadArgument(f"--steps {text!r} is empty: B must be greater than A")
    return bounds


def _step_of(doc: dict[str, Any]) -> int | None:
    """The training step a group belongs to: its consumed step, else its claimed step."""
    return doc["consumed_step"] if doc.get("consumed_step") is not None else doc.get("claimed_step")


@dataclass
class _Batch:
    meta: list[tuple[Any, ...]] = field(default_factory=list)
    arrays: dict[str, list[np.ndarray]] = field(default_factory=dict)
    input_ids: list[np.ndarray] = field(default_factory=list)
    split: list[int] = field(default_factory=list)
    raw_bytes: int = 0


def _widen(arr: np.ndarray, dtype: str) -> np.ndarray:
    """bfloat16 bits -> float32 (exact); everything else unchanged."""
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _arrow_type(pa: Any, dtype: str) -> Any:
    """The Arrow type of a field's values: text as ``string`` / ``binary``, bfloat16 widened."""
    if dtype in codec.TEXT_DTYPES:
        return pa.string() if dtype == "str" else pa.binary()
    return pa.from_numpy_dtype(_widen(np.zeros(0, codec.DTYPES[dtype]), dtype).dtype)


def _json_value(value: Any) -> Any:
    """A field value as JSON: arrays as (nested) lists, text as is, bytes as base64 text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return value.tolist()


def export(path: str, out: str, *, fmt: str = "parquet", states: Sequence[str] | None = None,
           steps: tuple[int | None, int | None] | None = None, fields: Sequence[str] | None = None,
           tokenizer: str | None = None, force: bool = False, batch_bytes: int = DEFAULT_BATCH_BYTES,
           progress: Progress | None = None, sft: bool = False,
           completion_mask: str = DEFAULT_COMPLETION_MASK) -> ExportResult:
    """Export the rows of ``path`` to ``out``; see the module docstring.

    Args:
        path: a live store or a checkpoint file (read-only).
        out: the file to write.
        fmt: ``"parquet"`` or ``"jsonl"``. Defaults to ``"parquet"``.
        states: group states to export. Defaults to :data:`STATES_WITH_ROWS` (evicted and aborted
            groups have no rows).
        steps: half-open ``(A, B)`` range of training steps (:func:`parse_steps`); keeps only
            groups claimed or consumed at such a step. Defaults to every group.
        fields: row fields to export. Defaults to every field of the schema.
        tokenizer: a local Hugging Face tokenizer (directory) to detokenize ``input_ids`` into a
            ``text`` column (special tokens skipped); needs ``transformers``. Defaults to None.
        force: replace an existing ``out``. Defaults to False.
        batch_bytes: raw row bytes buffered before a batch is written. Defaults to 32 MiB.
        progress: called with ``(groups scanned, groups in the store)``.
        sft: add the SFT layout's columns (see the module docstring). Defaults to False.
        completion_mask: the token field whose first non-zero position starts the completion.
            Defaults to ``"token_mask"``.

    Raises:
        BadArgument: bad format, state, field, step range or destination, a missing optional
            dependency, or a store without a replay buffer.
        CorruptRecord: a record failed its checksum (nothing is left under ``out``).
    """
    path, out = os.fspath(path), os.fspath(out)
    if fmt not in FORMATS:
        raise BadArgument(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    wanted = tuple(states) if states else STATES_WITH_ROWS
    unknown = [s for s in wanted if s not in GROUP_STATES]
    if unknown:
        raise BadArgument(f"unknown state(s) {', '.join(unknown)}; choose from {', '.join(GROUP_STATES)}")
    check_destination(path, out, force)
    sink_class = _ParquetSink if fmt == "parquet" else _JsonlSink
    sink_class.check_available()
    decoder = _load_tokenizer(tokenizer) if tokenizer else None
    t0 = time.perf_counter()
    with durable_replace(out, check=lambda: check_destination(path, out, force)) as tmp:
        job = _Job(out, tmp, fmt, sink_class, wanted, steps, fields, decoder, sft, completion_mask, batch_bytes,
                   progress)
        with open_readonly(path) as store, store.reader() as txn:
            result = kinds.kind_of(txn).hook("export", path)(txn, path, job)
    result.file_bytes = os.path.getsize(out)
    result.seconds = time.perf_counter() - t0
    result.warnings = _warnings(result, wanted, steps)
    return result


@dataclass
class _Job:
    """What :func:`export` was asked for, handed to the store kind's ``export`` hook."""

    out: str
    tmp: str
    fmt: str
    sink_class: Any
    states: tuple[str, ...]
    steps: tuple[int | None, int | None] | None
    fields: Sequence[str] | None
    decoder: Any
    sft: bool
    completion_mask: str
    batch_bytes: int
    progress: Progress | None


def _export_buffer(txn: Any, path: str, job: _Job) -> ExportResult:
    """A replay buffer's rows, streamed from one snapshot into ``job``'s sink (the ``export`` hook)."""
    config = txn.get_json("meta", CONFIG_KEY)
    if config is None:
        raise BadArgument(f"{path!r} holds no replay buffer (no meta/config): nothing to export")
    schema = RowSchema.from_dict(config["schema"])
    names = _check_fields(schema, job.fields, job.decoder is not None)
    layout = _Layout(names, job.decoder, _sft_store_id(txn, schema, names, job.completion_mask) if job.sft else None,
                     job.completion_mask)
    result = ExportResult(job.out, job.fmt, names)
    sink = _BackgroundSink(job.sink_class(job.tmp, schema, layout))
    try:
        total = txn.count("groups")
        batch = _Batch(arrays={n: [] for n in names})
        for done, (key, value) in enumerate(txn.iter_prefix("groups", b""), 1):
            doc = codec.decode_meta(value, f"groups/{key.decode(errors='replace')}")
            if job.progress is not None:
                job.progress(done, total)
            if doc["state"] not in job.states:
                continue
            if job.steps is not None and not _in_range(_step_of(doc), job.steps):
                continue
            if not doc.get("rows_stored"):
                result.groups_without_rows += 1
                continue
            result.groups += 1
            _add_group(txn, doc, schema, names, batch, layout)
            if batch.raw_bytes >= job.batch_bytes:
                result.rows += len(batch.meta)
                result.raw_bytes += batch.raw_bytes
                sink.write(batch)
                batch = _Batch(arrays={n: [] for n in names})
        result.rows += len(batch.meta)
        result.raw_bytes += batch.raw_bytes
        if batch.meta:
            sink.write(batch)
        if job.progress is not None:
            job.progress(total, total)
    finally:
        sink.close()
    return result


def _warnings(result: ExportResult, states: Sequence[str], steps: tuple[int | None, int | None] | None) -> list[str]:
    """What a person exporting training data must hear: nothing matched, or rows are gone."""
    where = f"state {','.join(states)}" + ("" if steps is None else " and steps {}:{}".format(
        *("" if b is None else b for b in steps)))
    out = []
    if result.groups_without_rows:
        out.append(f"{result.groups_without_rows:,} group(s) matching {where} have no rows: consumed groups' rows are "
                   "dropped once enough later checkpoints cover their step (set retain_consumed=True in the buffer "
                   "config, or export a checkpoint taken before), evicted and aborted ones never keep any")
    if not result.rows:
        out.append(f"nothing exported: no rows match {where}")
    return out


@dataclass(frozen=True)
class _Layout:
    """The columns a sink writes: the fields, ``text`` with a decoder, the SFT columns with a store id."""

    names: list[str]
    decoder: Any
    store_id: str | None
    completion_mask: str

    @property
    def sft(self) -> bool:
        return self.store_id is not None


def _sft_store_id(txn: Any, schema: RowSchema, names: list[str], mask: str) -> str:
    """The store id for the SFT layout, after checking the schema has what the split needs."""
    missing = [n for n in ("input_ids", mask) if n not in schema.fields or schema.fields[n].kind != "token"]
    if missing:
        raise BadArgument(f"--sft needs token fields input_ids and {mask!r} (the completion mask); this store's "
                          f"schema lacks {', '.join(repr(m) for m in missing)}")
    clash = [n for n in names if n in SFT_COLUMNS + SFT_TEXT_COLUMNS]
    if clash:
        raise BadArgument(f"field(s) {', '.join(clash)} clash with the SFT columns; leave them out with --fields")
    info = txn.get_json("meta", b"format") or {}
    return str(info.get("store_id", ""))


def _in_range(step: int | None, bounds: tuple[int | None, int | None]) -> bool:
    lo, hi = bounds
    return step is not None and (lo is None or step >= lo) and (hi is None or step < hi)


def _check_fields(schema: RowSchema, fields: Sequence[str] | None, decode: bool) -> list[str]:
    names = list(schema.fields) if not fields else list(dict.fromkeys(fields))
    unknown = [n for n in names if n not in schema.fields]
    if unknown:
        raise BadArgument(f"unknown field(s) {', '.join(unknown)}; the store's fields are "
                          f"{', '.join(schema.fields)}")
    reserved = set(META_COLUMNS) | ({TEXT_COLUMN} if decode else set())
    clash = [n for n in names if n in reserved]
    if clash:
        raise BadArgument(f"field(s) {', '.join(clash)} clash with export metadata columns; leave them out "
                          "with --fields")
    if decode and "input_ids" not in schema.fields:
        raise BadArgument("--decode needs an input_ids field, and this store's schema has none")
    return names


def _add_group(txn: Any, doc: dict[str, Any], schema: RowSchema, names: list[str], batch: _Batch,
               layout: _Layout) -> None:
    gid = doc["group_id"]
    check_group_digest(gid, doc.get("digest"), [v for _, v in txn.iter_prefix("rows", keys.row_prefix(gid))])
    for key, value in txn.iter_prefix("rows", keys.row_prefix(gid)):
        index = int.from_bytes(key[-4:], "big")
        where = f"rows/{keys.row_id(gid, index)}"
        record = codec.decode(value, where)
        if record.meta.get("group_id") != gid or record.meta.get("index") != index:
            raise InvariantViolation(f"row {keys.row_id(gid, index)} holds the payload of "
                                     f"{record.meta.get('group_id')!r} row {record.meta.get('index')!r}")
        try:  # what read_batch checks too: a row of another dtype or shape than the schema is damage
            schema.check_record(record, where)
        except SchemaMismatch as exc:
            raise CorruptRecord(where, str(exc)) from None
        batch.meta.append((gid, index, doc["prompt_idx"], doc["task_name"], doc["state"], doc["start_weight"],
                           doc["end_weight"], doc.get("target_step"), doc.get("claimed_step"),
                           doc.get("consumed_step"), doc["seq"]))
        for name in names:
            arr = record.arrays.get(name)
            if arr is not None:
                batch.raw_bytes += codec.value_nbytes(arr)
                arr = _widen(arr, record.dtypes[name])
            batch.arrays[name].append(arr)
        if layout.decoder is not None or layout.sft:
            batch.input_ids.append(record.arrays["input_ids"])
        if layout.sft:
            nonzero = np.flatnonzero(record.arrays[layout.completion_mask])
            batch.split.append(int(nonzero[0]) if nonzero.size else len(record.arrays["input_ids"]))


def _load_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BadArgument("--decode needs the transformers package: pip install transformers") from None
    if not os.path.isdir(path):
        raise BadArgument(f"--decode expects a local tokenizer directory, {path!r} is not one")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"cannot load a tokenizer from {path!r}: {exc}") from None


def _texts(decoder: Any, ids: list[np.ndarray]) -> list[str]:
    return decoder.batch_decode([a.tolist() for a in ids], skip_special_tokens=True)


def _extra_columns(layout: _Layout, batch: _Batch) -> dict[str, list[Any]]:
    """The ``text`` and SFT columns of a batch, by name, in output order."""
    out: dict[str, list[Any]] = {}
    if layout.decoder is not None:
        out[TEXT_COLUMN] = _texts(layout.decoder, batch.input_ids)
    if layout.sft:
        prompts = [ids[:cut] for ids, cut in zip(batch.input_ids, batch.split, strict=True)]
        completions = [ids[cut:] for ids, cut in zip(batch.input_ids, batch.split, strict=True)]
        out.update(store_id=[layout.store_id] * len(batch.meta), prompt_ids=prompts, completion_ids=completions)
        if layout.decoder is not None:
            out.update(prompt=_texts(layout.decoder, prompts), completion=_texts(layout.decoder, completions))
    return out


class _BackgroundSink:
    """Writes batches on a thread, so decoding the next batch overlaps encoding this one (pyarrow and
    zstd release the GIL). At most one batch waits in the queue: memory stays about three batches."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink
        self._queue: queue.Queue[_Batch | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvckpt-export-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._sink.write(batch)
                except BaseException as exc:
                    self._error = exc

    def write(self, batch: _Batch) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(batch)

    def close(self) -> None:
        """Write what is queued and close the file; re-raises the writer's error, if any."""
        self._queue.put(None)
        self._thread.join()
        try:
            self._sink.close()
        finally:
            if self._error is not None:
                raise self._error


class _JsonlSink:
    """One JSON object per row."""

    @staticmethod
    def check_available() -> None:
        """JSONL needs nothing beyond the standard library."""

    def __init__(self, path: str, schema: RowSchema, layout: _Layout) -> None:
        self._file = open(path, "x", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self._layout = layout

    def write(self, batch: _Batch) -> None:
        extra = _extra_columns(self._layout, batch)
        lines = []
        for i, meta in enumerate(batch.meta):
            row = dict(zip(META_COLUMNS, meta, strict=True))
            for name in self._layout.names:
                arr = batch.arrays[name][i]
                row[name] = _json_value(arr)
            for name, values in extra.items():
                value = values[i]
                row[name] = value.tolist() if isinstance(value, np.ndarray) else value
            lines.append(json.dumps(row, separators=(",", ":")))
        self._file.write("\n".join(lines) + "\n")

    def close(self) -> None:
        self._file.close()


class _ParquetSink:
    """Arrow columns per batch, one Parquet row group per batch; the schema comes from the first
    batch (a row field's shape is only known from data)."""

    @staticmethod
    def check_available() -> None:
        """Parquet needs pyarrow (the ``export`` extra)."""
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise BadArgument("Parquet export needs pyarrow: pip install 'kvckpt[export]' "
                              "(or use --format jsonl)") from None

    def __init__(self, path: str, schema: RowSchema, layout: _Layout) -> None:
        import pyarrow as pa

        self._pa = pa
        self._path = path
        self._schema = schema
        self._layout = layout
        self._names = layout.names
        self._writer: Any = None
        self._arrow_schema: Any = None
        self._meta_types = [pa.string(), pa.int32(), pa.int64(), pa.string(), pa.string(), pa.int64(), pa.int64(),
                            pa.int64(), pa.int64(), pa.int64(), pa.int64()]

    def _column(self, name: str, arrays: list[np.ndarray | None]) -> Any:
        pa = self._pa
        spec = self._schema.fields[name]
        value_type = _arrow_type(pa, spec.dtype)
        if spec.dtype in codec.TEXT_DTYPES:
            return pa.array(arrays, type=value_type)
        present = [a for a in arrays if a is not None]
        if spec.kind == "row" and present and all(a.ndim == 0 for a in present):
            if len(present) == len(arrays):
                return pa.array(np.stack(present), type=value_type)
            return pa.array([None if a is None else a.item() for a in arrays], type=value_type)
        return _nested(pa, arrays, value_type)

    def _empty_schema(self) -> Any:
        """The schema of a file without rows: row fields are assumed scalar."""
        pa = self._pa
        fields = [pa.field(n, t) for n, t in zip(META_COLUMNS, self._meta_types, strict=True)]
        for name in self._names:
            spec = self._schema.fields[name]
            value_type = _arrow_type(pa, spec.dtype)
            fields.append(pa.field(name, pa.list_(value_type) if spec.kind == "token" else value_type))
        ids = pa.list_(pa.int64())
        types = {TEXT_COLUMN: pa.string(), "store_id": pa.string(), "prompt_ids": ids, "completion_ids": ids,
                 "prompt": pa.string(), "completion": pa.string()}
        fields += [pa.field(name, types[name]) for name in _extra_columns(self._layout, _Batch())]
        return pa.schema(fields)

    def write(self, batch: _Batch) -> None:
        pa = self._pa
        columns = [pa.array(list(col), type=t) for col, t in zip(zip(*batch.meta, strict=True), self._meta_types,
                                                                  strict=True)]
        names = list(META_COLUMNS)
        for name in self._names:
            columns.append(self._column(name, batch.arrays[name]))
            names.append(name)
        for name, values in _extra_columns(self._layout, batch).items():
            ids = name in ("prompt_ids", "completion_ids")
            columns.append(_nested(pa, values, pa.int64()) if ids else pa.array(values, type=pa.string()))
            names.append(name)
        table = pa.Table.from_arrays(columns, names=names)
        if self._writer is None:
            import pyarrow.parquet as pq

            # Dictionary-encode only the repetitive metadata strings: on token lists it costs a third of the
            # write time for nothing. zstd: about 35% smaller files than snappy for a little more time.
            # Statistics only for the metadata columns: min/max of token lists serve no query and cost a
            # fifth of the write time.
            self._writer = pq.ParquetWriter(self._path, table.schema, compression="zstd",
                                            use_dictionary=["group_id", "task_name", "state"],
                                            write_statistics=list(META_COLUMNS))
            self._arrow_schema = table.schema
        elif table.schema != self._arrow_schema:
            raise BadArgument(f"a row field changes rank between rows ({table.schema} vs {self._arrow_schema}); "
                              "export it with --format jsonl")
        self._writer.write_table(table, row_group_size=table.num_rows)

    def close(self) -> None:
        if self._writer is None:  # no rows: still a valid (empty) file with the metadata columns
            import pyarrow.parquet as pq

            pq.write_table(self._empty_schema().empty_table(), self._path)
            return
        self._writer.close()


def _nested(pa: Any, arrays: list[np.ndarray | None], value_type: Any) -> Any:
    """A (nested) list column: one level per array dimension; ``None`` for a missing value."""
    ndim = next((a.ndim for a in arrays if a is not None), 1)
    if ndim == 0:
        raise BadArgument("a row field is a scalar in some rows and an array in others")
    lengths = np.array([0 if a is None else a.shape[0] for a in arrays], dtype=np.int64)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)  # a batch holds far fewer than 2**31 values
    np.cumsum(lengths, out=offsets[1:])
    mask = np.array([a is None for a in arrays]) if any(a is None for a in arrays) else None
    present = [a for a in arrays if a is not None]
    if ndim == 1:
        flat = np.concatenate(present) if present else np.zeros(0)
        values = pa.array(flat, type=value_type)
    else:
        values = _nested(pa, [sub for a in present for sub in a], value_type)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), values,
                                    mask=None if mask is None else pa.array(mask))


kinds.attach("replay-buffer", export=_export_buffer)
