"""NeMo-RL's own ``RolloutManager.generate_and_push``, with the prompt it works for known to the buffer, and the
re-issue of every prompt a restart left in flight through it.

:func:`install_generate_and_push` wraps the method on NeMo-RL's class (idempotent; :func:`~.swap.install` does it
when NeMo-RL is importable): each call runs NeMo-RL's own body unchanged inside
:func:`~.dispatch.dispatching` of its ``input_sample``, so its ``reserve`` records the prompt (``idx``,
``task_name``): no in-flight entry is anonymous, and a restart can re-issue every one.

:func:`reissue_inflight` walks the leases a recovery handed the ledger (``set_dispatch_index`` after a restart,
``load_state_dict`` or ``restore_replay_buffer``) and calls ``generate_and_push`` once per lease with that lease's
group id bound, concurrently: NeMo-RL's retry loop, commit and cleanup run as for any prompt, and ``reserve``
takes the recovered lease instead of opening an entry. Exactly once: a lease leaves the ledger's idle set when
``reserve`` takes it, so a second walk finds it no more; the old attempt was fenced by the recovery, so a worker
of the killed run can write neither a commit nor progress (``StaleAttempt``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import Any

from kvckpt.integrations.nemo_rl.dispatch import dispatching
from kvckpt.integrations.nemo_rl.engine import KeyedGeneration
from kvckpt.integrations.nemo_rl.remote import service_for

from kvckpt import Lease
from kvckpt.errors import BadArgument


def install_generate_and_push(manager_cls: type) -> None:
    """Wrap ``manager_cls.generate_and_push`` (NeMo-RL's ``RolloutManager``) so each call binds its prompt
    (:func:`~.dispatch.dispatching`); ``group_id=`` (kvckpt's keyword) binds a recovered group id too."""
    original = manager_cls.generate_and_push
    if getattr(original, "kvckpt_original", None) is not None:
        return

    @functools.wraps(original)
    async def generate_and_push(self: Any, input_sample: Mapping[str, Any], *args: Any, group_id: str | None = None,
                                **kwargs: Any) -> Any:
        key_generation(self)
        with dispatching(input_sample, group_id):
            return await original(self, input_sample, *args, **kwargs)

    generate_and_push.kvckpt_original = original  # type: ignore[attr-defined]
    manager_cls.generate_and_push = generate_and_push


def key_generation(manager: Any) -> None:
    """With the manager's buffer configured for token progress (``progress_every_tokens``): start the desk NeMo-RL's
    Ray workers write to, in this process (the one that owns the store: :func:`~.remote.service_for`), and key the
    manager's ``policy_generation`` (:class:`~.engine.KeyedGeneration` carrying the desk's settings). Once per
    manager; a manager keyed already (a test's, or one built with a ``KeyedGeneration``) is left as it is.

    NeMo-RL's names it reads (``7ea279ab``): the manager's ``_tq_buffer`` and ``_tokenizer``, and the
    ``_policy_generation`` of its rollout implementation (``_impl``; the manager itself for the legacy one).
    """
    buffer = getattr(manager, "_tq_buffer", None)
    if not getattr(buffer, "progress_every_tokens", 0):
        return
    impl = getattr(manager, "_impl", manager)
    inner = getattr(impl, "_policy_generation", None)
    if inner is None or isinstance(inner, KeyedGeneration):
        return
    service = service_for(buffer, eos=getattr(getattr(manager, "_tokenizer", None), "eos_token_id", None))
    impl._policy_generation = KeyedGeneration(inner, service.settings)


async def reissue_inflight(rollout_manager: Any, buffer: Any, sample_of: Callable[[Lease], Mapping[str, Any]],
                           ) -> dict[str, Any]:
    """Re-issue every lease the buffer's ledger holds idle through ``rollout_manager.generate_and_push`` (its
    class wrapped by :func:`install_generate_and_push`), concurrently, each once with its group id and
    ``target_step``; returns each group id's outcome (NeMo-RL's ``RolloutOutcome``) or the exception it raised.

    Args:
        rollout_manager: NeMo-RL's ``RolloutManager`` built with ``tq_buffer=buffer``.
        buffer: the kvckpt ``TQReplayBuffer`` after its recovery.
        sample_of: the trainer's prompt (a NeMo-RL ``DatumSpec``) of a lease (its ``prompt_idx``, ``task_name``):
            the store keeps each prompt's identity, the payload stays the trainer's.

    Raises:
        BadArgument: ``generate_and_push`` of ``rollout_manager``'s class is not wrapped (the re-issue would
            open new entries instead of taking the recovered leases).
    """
    if getattr(type(rollout_manager).generate_and_push, "kvckpt_original", None) is None:
        raise BadArgument(f"{type(rollout_manager).__name__}.generate_and_push is not wrapped: call "
                          "install_generate_and_push on its class first, or the re-issue opens new entries")
    leases = buffer.handle.idle_leases()
    results = await asyncio.gather(*(rollout_manager.generate_and_push(sample_of(lease), group_id=lease.group_id,
                                                                       target_step=lease.target_step)
                                     for lease in leases), return_exceptions=True)
    return {lease.group_id: result for lease, result in zip(leases, results, strict=True)}
