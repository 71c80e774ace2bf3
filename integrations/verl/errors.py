"""The refusal of the verl ledger: a write from a process of a run that a restart replaced. (A progress chunk
that would leave a gap is the replay buffer's refusal, :class:`kvckpt.errors.ProgressGap`, re-exported here.)"""

from __future__ import annotations

from kvckpt.errors import ProgressGap, StaleAttempt

__all__ = ["ProgressGap", "StaleRun"]


class StaleRun(StaleAttempt):
    """A rollout worker (or trainer) of an earlier run wrote to the ledger after a restart.

    Every process that writes verl's TransferQueue traffic carries the token of the run it joined.
    A restart opens a new run in one transaction, so every write of the old run's processes is
    refused from then on, before it reaches the ledger or TransferQueue: a re-issued prompt has
    exactly one generation that can land.
    """

    def __init__(self, path: str, run: str, current: str | None) -> None:
        self.path, self.run, self.current = path, run, current
        super().__init__(f"verl ledger {path!r}: a write from run {run!r} refused; the ledger's run is now "
                         f"{current!r} (a restart replaced that run, whose prompts were re-issued)")

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        return (type(self), (self.path, self.run, self.current))
