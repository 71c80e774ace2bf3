"""Admission: prompts leave the dataloader and become ledger entries with leases.

Both transitions first ask :func:`blocker` whether the gate (gated samplers: ``dispatch_index <
trainer_version + W``) and capacity (in flight + ready <= ``max_buffered_rollouts``) let them
through; a blocker string means nothing was written and the caller waits outside the transaction.
"""

from __future__ import annotations

from typing import Any

from kvckpt.errors import BadArgument
from kvckpt.tables.access import Tables
from kvckpt.tables.records import Admission, Lease, LedgerEntry, Prompt
from kvckpt.transitions.config import BufferConfig


def blocker(config: BufferConfig, st: dict[str, Any], count: int, gated: bool = True) -> str | None:
    """Why ``count`` prompts cannot be admitted now (the gate, or capacity), or ``None``."""
    gate = config.sampler.gate_window if gated else None
    if gate is not None and st["dispatch_index"] >= st["trainer_version"] + gate:
        return (f"gate closed: dispatch_index {st['dispatch_index']} >= trainer_version "
                f"{st['trainer_version']} + window {gate}")
    if st["inflight"] + st["ready"] + count > config.max_buffered_rollouts:
        return (f"capacity: {st['inflight']} in flight + {st['ready']} ready + {count} > "
                f"max_buffered_rollouts {config.max_buffered_rollouts}")
    return None


def advance(t: Tables, config: BufferConfig, dataloader_state: bytes | None) -> Admission | str:
    """``advance_dispatch``: a new admission (the cursor + 1 for gated samplers) and the dataloader
    state, without prompts; or a blocker."""
    st = t.state()
    why = blocker(config, st, 0)
    if why is not None:
        return why
    admission = _new_admission(config, st)
    t.put_dataloader_state(dataloader_state)
    t.put_state(st)
    return admission


def admit(t: Tables, config: BufferConfig, store_id: str, batch: list[Prompt], dataloader_state: bytes | None,
          weight_version: int | None, admission: Admission | None, holder: str | None = None) -> list[Lease] | str:
    """``admit``: one ledger entry (and lease) per prompt, under a new admission or a joined one,
    each recording ``holder``; or a blocker.

    Raises:
        BadArgument: a group id already in use, or an ``admission`` this store did not issue.
    """
    st = t.state()
    why = blocker(config, st, len(batch), gated=admission is None)
    if why is not None:
        return why
    if admission is None:
        admission = _new_admission(config, st)
        id_format = f"{admission.admission_id}-p{{j}}"
    else:
        _check_joined(st, admission)
        id_format = f"{admission.admission_id}-s{{seq}}"  # a joined admission's prompts arrive over many calls
    start_weight = st["weight_version"] if weight_version is None else weight_version
    leases = []
    for j, prompt in enumerate(batch):
        gid = prompt.group_id or _free_id(t, id_format.format(j=j, seq=st["seq"]))
        if t.in_use(gid):
            raise BadArgument(f"group id {gid!r} is already in use in this store")
        entry = LedgerEntry(gid, admission.admission_id, prompt.prompt_idx, prompt.task_name, config.group_size,
                            admission.target_step, start_weight, attempt=0, seq=st["seq"], timeline=st["timeline"],
                            holder=holder)
        st["seq"] += 1
        t.add_entry(entry)
        leases.append(entry.lease(store_id))
    st["inflight"] += len(batch)
    st["counters"]["admitted"] += len(batch)
    t.put_dataloader_state(dataloader_state)
    t.put_state(st)
    return leases


def _new_admission(config: BufferConfig, st: dict[str, Any]) -> Admission:
    """Advance the cursor (gated samplers) and issue the next admission id, in ``st``."""
    target = None
    if config.sampler.gate_window is not None:
        st["dispatch_index"] += 1
        if config.sampler.stamps_target_step:
            target = st["dispatch_index"]
    admission = Admission(f"a{st['admissions']}", st["dispatch_index"], target)
    st["admissions"] += 1
    return admission


def _check_joined(st: dict[str, Any], admission: Admission) -> None:
    number = admission.admission_id[1:]
    if not (admission.admission_id.startswith("a") and number.isdigit() and int(number) < st["admissions"]):
        raise BadArgument(f"admission {admission.admission_id!r} was not issued by this store "
                          f"({st['admissions']} admissions so far)")
    if admission.target_step is not None and admission.target_step > st["dispatch_index"]:
        raise BadArgument(f"admission {admission.admission_id!r} is stamped for step {admission.target_step}, "
                          f"past the store's dispatch_index {st['dispatch_index']}")


def _free_id(t: Tables, gid: str) -> str:
    """``gid``, or ``gid.N`` if a caller already chose it: a generated id never blocks admission."""
    candidate, n = gid, 0
    while t.in_use(candidate):
        n += 1
        candidate = f"{gid}.{n}"
    return candidate
