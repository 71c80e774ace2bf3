"""What the verl tests share: verl's trainer-base test stub and one loopback Ray with TransferQueue.

Imported by tests/integrations/verl/test_verl_*.py and by tests/_verl_run.py (the crash test's child program), only
inside ``.venv-verl``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from verl.trainer.ppo.v1.trainer_base import PPOTrainer


class StubTrainer(PPOTrainer):
    """verl's ``_StubTrainer`` (``test_trainer_base_on_cpu.py`` line 23): the two abstract hooks, nothing
    else; build it with ``StubTrainer.__new__(StubTrainer)`` and set the attributes a test needs."""

    def on_step_end(self) -> None:
        pass

    def on_sample_end(self) -> None:
        pass


@contextlib.contextmanager
def transferqueue(namespace: str, ledger_actor: str | None = None) -> Iterator[None]:
    """A loopback Ray of its own (``address="local"``: never another process's cluster on a shared machine)
    with 8 logical CPUs (TransferQueue's default actors hang ``tq.init`` with 3 on a 2-core machine) and
    ``tq.init()``; afterwards the mirror is removed, the ledger actor stopped,
    TransferQueue closed and Ray shut down."""
    import ray
    import transfer_queue as tq
    from kvckpt.integrations.ray import init_local_ray
    from kvckpt.integrations.verl.mirror import NAMESPACE, uninstall

    init_local_ray(num_cpus=8, object_store_memory=256 << 20, namespace=namespace, address="local")
    tq.init()
    try:
        yield
    finally:
        uninstall()
        if ledger_actor is not None:
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(ledger_actor, namespace=NAMESPACE))
        tq.close()
        ray.shutdown()
