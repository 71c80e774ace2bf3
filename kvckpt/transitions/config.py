"""What a buffer is: its persisted configuration."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvckpt import args
from kvckpt.errors import BadArgument
from kvckpt.samplers import create_sampler
from kvckpt.storage import codec
from kvckpt.storage.schema import RowSchema


@dataclass
class BufferConfig:
    """What a buffer is, persisted in the store so a reopen needs no arguments.

    Args:
        group_size: rows per group (n completions per prompt).
        schema: the row schema (a :class:`RowSchema` or its dict form).
        sampler: a sampler config dict (``{"name": "in_order", "max_lookahead_versions": 1}``),
            a name, or a :class:`~kvckpt.samplers.Sampler`.
        max_buffered_rollouts: capacity: in-flight plus ready groups never exceed it.
        groups_per_step: prompts per training step; used to refuse a capacity that deadlocks.
        retain_consumed: keep consumed groups' rows (for replay or SFT export). Defaults to False.
        compression_level: zstd level of row payloads, 0 for none. Defaults to 1.
        durable_checkpoints: consumed rows are dropped only once this many later checkpoints
            exist, so a trainer can still resume from an older model checkpoint. Defaults to 2.
        wait_timeout: seconds ``admit`` and ``advance_dispatch`` wait for the gate or capacity when
            the caller gives no ``timeout`` (then :class:`~kvckpt.errors.GateTimeout`); ``None``
            waits forever. Waits are logged on ``kvckpt.buffer``. Defaults to 600.
    """

    group_size: int
    schema: RowSchema | Mapping[str, Any]
    sampler: Any = "in_order"
    max_buffered_rollouts: int = 64
    groups_per_step: int = 1
    retain_consumed: bool = False
    compression_level: int = codec.DEFAULT_LEVEL
    durable_checkpoints: int = 2
    wait_timeout: float | None = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.schema, RowSchema):
            self.schema = RowSchema.from_dict(self.schema) if "fields" in self.schema else RowSchema(self.schema)
        self.sampler = create_sampler(self.sampler)
        for name in ("group_size", "max_buffered_rollouts", "groups_per_step", "durable_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadArgument(f"{name} must be an integer >= 1, got {value!r}")
        self.wait_timeout = args.timeout("wait_timeout", self.wait_timeout)
        if self.wait_timeout is not None and not math.isfinite(self.wait_timeout):
            raise BadArgument("wait_timeout must be finite; None waits forever")
        self.sampler.check_capacity(self.max_buffered_rollouts, self.groups_per_step)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored under ``meta/config``."""
        return {"group_size": self.group_size, "schema": self.schema.to_dict(),
                "sampler": self.sampler.config(), "max_buffered_rollouts": self.max_buffered_rollouts,
                "groups_per_step": self.groups_per_step, "retain_consumed": self.retain_consumed,
                "compression_level": self.compression_level, "durable_checkpoints": self.durable_checkpoints,
                "wait_timeout": self.wait_timeout}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> BufferConfig:
        """Inverse of :meth:`to_dict`."""
        return cls(**dict(doc))
