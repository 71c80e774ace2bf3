"""Ledger format 1's token progress, moved into format 2 when a ledger opens (:func:`upgrade_progress`).

Format 1 (kvckpt before issue 45) recorded each progress chunk of a sample as three TransferQueue value records,
``verl/progress/{uid}/{session}/{start:010d}/{t|l|v}`` (token ids, logprobs and weight versions as tensors) and a
finished sample's ``verl/progress/{uid}/{session}/done``, under the ledger's own rules. Format 2 records progress
through the replay buffer's rules (``ValueStore.record_progress``; :mod:`.records`): one record per chunk of one
weight version, and the done mark at ``verl/progress/{uid}/{session}.done``. Everything else in the file is the
same in both. The upgrade reads every format-1 sample, checks its chunks tile its prefix from token 0, and
rewrites it as format 2 in ONE write transaction (every format-1 record deleted, the same tokens, logprobs,
versions and done marks written), so a crash leaves the file in one format or the other; a file with no
format-1 record is left as it is.
"""

from __future__ import annotations

from typing import Any

from kvckpt.integrations.transferqueue.values import decode_value, encode_value, new_write_id
from kvckpt.integrations.verl.records import PROGRESS, done_key, progress_prefix

from kvckpt import ValueStore, write_id_of
from kvckpt.errors import CorruptRecord, FormatError

_FIELDS = {"t": "tokens", "l": "logprobs", "v": "versions"}
_LEVEL = 1


def upgrade_progress(values: ValueStore, max_tokens: int) -> int:
    """Move every format-1 progress record of ``values`` into format 2 (one transaction); returns how many
    samples moved (0 when the file holds none).

    Raises:
        CorruptRecord: a format-1 sample's chunks leave a gap or a record fails its checksum (nothing changes).
        FormatError: a format-1 sample the buffer's rules refuse (e.g. longer than ``max_tokens``; nothing changes).
    """
    old = [k for k in values.keys(PROGRESS) if k.rsplit("/", 1)[-1] in (*_FIELDS, "done")]
    if not old:
        return 0
    samples: dict[tuple[str, int], dict[str, Any]] = {}
    for key, raw in zip(old, values.get(old), strict=True):
        uid, session, *rest = key[len(PROGRESS):].split("/")
        sample = samples.setdefault((uid, int(session)), {"tokens": [], "logprobs": [], "versions": [], "done": False})
        if rest == ["done"]:
            sample["done"] = True
            continue
        start, name = int(rest[0]), _FIELDS[rest[1]]
        if len(sample[name]) != start:
            raise CorruptRecord(key, f"verl ledger format 1: the progress of {uid}/{session} has a gap at {start}")
        sample[name] += decode_value(key, raw, write_id_of(raw, key)).tolist()
    items = [{"group": uid, "index": session, "start": 0, "tokens": s["tokens"], "logprobs": s["logprobs"],
              "versions": s["versions"]} for (uid, session), s in samples.items()]
    marks = [done_key(uid, session) for (uid, session), s in samples.items() if s["done"]]
    results = values.record_progress(
        items, max_tokens=max_tokens, prefix=PROGRESS, drop=[progress_prefix(u, s) for u, s in samples],
        then=lambda out: (marks, [encode_value(k, {}, new_write_id(), _LEVEL) for k in marks])
        if all(isinstance(r, int) for r in out) else _refuse(out))
    return len(results)


def _refuse(results: list[Any]) -> tuple[list[str], list[bytes]]:
    """Abort the upgrade's transaction: a sample the buffer's rules refuse."""
    raise FormatError(f"verl ledger format 1: a sample's progress cannot be moved into format 2: "
                      f"{next(r for r in results if not isinstance(r, int))}")
