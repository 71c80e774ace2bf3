"""The one config section the kvckpt verl buffer reads: ``trainer.v1.sampler.sampler_kwargs.kvckpt``.

verl hands its custom sampler ``sampler_kwargs`` unchanged (``trainer_base._build_replay_buffer``),
so the ledger's settings live there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvckpt.errors import BadArgument


@dataclass(frozen=True)
class LedgerSettings:
    """Where the ledger lives and which Ray actor owns it.

    Attributes:
        path: the live ledger file, on a local disk of the node that constructs the buffer (required).
        actor_name: the Ray actor that owns the file; one per concurrent verl job.
    """

    path: str
    actor_name: str = "kvckpt_verl_ledger"

    @classmethod
    def from_sampler_kwargs(cls, sampler_kwargs: DictConfig | Mapping[str, Any] | None) -> LedgerSettings:
        """Read ``sampler_kwargs["kvckpt"]``.

        Raises:
            BadArgument: the section is missing, has unknown keys, or a value is not a non-empty string.
        """
        if isinstance(sampler_kwargs, DictConfig):
            sampler_kwargs = OmegaConf.to_container(sampler_kwargs, resolve=True)  # type: ignore[assignment]
        section = dict(sampler_kwargs or {}).get("kvckpt")
        if not isinstance(section, Mapping):
            raise BadArgument("the kvckpt verl buffer needs trainer.v1.sampler.sampler_kwargs.kvckpt.path "
                              "(the ledger file, on a local disk)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise BadArgument(f"unknown keys {unknown} in trainer.v1.sampler.sampler_kwargs.kvckpt; "
                              f"known: {sorted(known)}")
        for name, value in section.items():
            if not isinstance(value, str) or not value:
                raise BadArgument(f"trainer.v1.sampler.sampler_kwargs.kvckpt.{name} must be a non-empty string, "
                                  f"got {value!r}")
        if "path" not in section:
            raise BadArgument("trainer.v1.sampler.sampler_kwargs.kvckpt.path is required (the ledger file)")
        return cls(**section)
