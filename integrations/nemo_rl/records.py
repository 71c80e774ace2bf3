"""Tensorise what NeMo-RL's rollout hands ``commit``: a ``PromptGroupRecord`` into one row per completion.

NeMo-RL's ``record_to_train_batch`` flattens each completion's message log into one padded row;
kvckpt stores rows jagged (padding is applied on read), so :func:`record_to_rows` returns one dict
of tensors per completion, unpadded, with NeMo-RL's field names:

* ``input_ids``: every message's ``token_ids`` in order; ``token_mask``: 1 on assistant tokens;
  ``generation_logprobs``: the assistant messages' ``generation_logprobs`` (0 elsewhere);
* ``input_lengths`` (the row's token count), ``total_reward`` (the completion's ``reward``) and
  ``sample_mask`` (1.0) per row.

Already-tensorised input is accepted too: a mapping of batched tensors (``record_to_train_batch``'s
output: ``[N, L]`` token fields cut to each row's ``input_lengths``, ``[N]`` row fields) or a
sequence of row dicts. Nothing here imports NeMo-RL: records are read by attribute name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvckpt.errors import SchemaMismatch


def _tensor(value: Any, dtype: Any, where: str) -> Any:
    import torch

    try:
        return value.to(dtype) if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise SchemaMismatch(f"{where}: {type(value).__name__} is not a {dtype} tensor ({exc})") from None


def _completion_row(completion: Any, where: str) -> dict[str, Any]:
    import torch

    ids, mask, logprobs = [], [], []
    for m, message in enumerate(getattr(completion, "message_log", None) or ()):
        if not isinstance(message, Mapping) or "token_ids" not in message:
            raise SchemaMismatch(f"{where}: message {m} has no token_ids")
        tokens = _tensor(message["token_ids"], torch.int64, f"{where}: message {m} token_ids").reshape(-1)
        assistant = message.get("role") == "assistant"
        ids.append(tokens)
        mask.append(torch.full_like(tokens, int(assistant)))
        lp = message.get("generation_logprobs") if assistant else None
        lp = torch.zeros(len(tokens), dtype=torch.float32) if lp is None \
            else _tensor(lp, torch.float32, f"{where}: message {m} generation_logprobs").reshape(-1)
        if len(lp) != len(tokens):
            raise SchemaMismatch(f"{where}: message {m} has {len(tokens)} tokens but {len(lp)} generation_logprobs")
        logprobs.append(lp)
    if not ids:
        raise SchemaMismatch(f"{where}: the completion has an empty message_log")
    input_ids = torch.cat(ids)
    return {"input_ids": input_ids, "token_mask": torch.cat(mask), "generation_logprobs": torch.cat(logprobs),
            "input_lengths": torch.tensor(len(input_ids), dtype=torch.int64),
            "total_reward": _tensor(getattr(completion, "reward", 0.0), torch.float32, f"{where}: reward").reshape(()),
            "sample_mask": torch.tensor(1.0, dtype=torch.float32)}


def _batch_rows(batch: Mapping[str, Any], token_fields: Sequence[str]) -> list[dict[str, Any]]:
    import torch

    if "input_lengths" not in batch:
        raise SchemaMismatch(f"a tensorised group needs input_lengths, got fields {sorted(batch)}")
    lengths = [int(x) for x in _tensor(batch["input_lengths"], torch.int64, "input_lengths").reshape(-1).tolist()]
    rows: list[dict[str, Any]] = [{} for _ in lengths]
    for name, value in batch.items():
        value = value if isinstance(value, torch.Tensor) else _tensor(value, None, f"field {name!r}")
        if value.shape[:1] != (len(lengths),):
            raise SchemaMismatch(f"field {name!r} has shape {tuple(value.shape)}, not {len(lengths)} rows")
        if name in token_fields and (value.dim() != 2 or max(lengths, default=0) > value.shape[1]):
            raise SchemaMismatch(f"token field {name!r} has shape {tuple(value.shape)}, not [rows, >= "
                                 f"{max(lengths, default=0)}] for input_lengths {lengths}")
        for i, row in enumerate(rows):
            row[name] = value[i, :lengths[i]] if name in token_fields else value[i]
    return rows


def record_to_rows(record: Any, token_fields: Sequence[str]) -> list[dict[str, Any]]:
    """One row dict per completion of ``record`` (see the module docstring for what is accepted).

    Args:
        record: a ``PromptGroupRecord`` (anything with ``completions``), a mapping of batched
            tensors, or a sequence of row dicts (returned as they are).
        token_fields: the store schema's per-token fields (cut to ``input_lengths`` in a batch).

    Raises:
        SchemaMismatch: the record cannot be tensorised (no completions, no token ids, lengths
            that disagree); nothing is written then.
    """
    if hasattr(record, "completions"):
        completions = list(record.completions or ())
        if not completions:
            raise SchemaMismatch(f"PromptGroupRecord of prompt {getattr(record, 'prompt_idx', '?')} has no completions")
        return [_completion_row(c, f"completion {i}") for i, c in enumerate(completions)]
    if isinstance(record, Mapping):
        return _batch_rows(record, token_fields)
    if isinstance(record, Sequence) and all(isinstance(row, Mapping) for row in record):
        return [dict(row) for row in record]
    raise SchemaMismatch(f"commit needs a PromptGroupRecord, a batched tensor mapping or row dicts, "
                         f"got {type(record).__name__}")
