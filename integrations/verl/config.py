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

#: Default of ``progress_every_tokens``: kvckpt's own rollout worker's interval (a crash costs a sequence at
#: most 255 tokens; benchmarks/progress_bench.py measured generation with it at 100.9% of without).
PROGRESS_EVERY_TOKENS = 256


@dataclass(frozen=True)
class LedgerSettings:
    """Where the ledger lives and which Ray actor owns it.

    Attributes:
        path: the live ledger file, on a local disk of the node that constructs the buffer (required).
        actor_name: the Ray actor that owns the file; one per concurrent verl job.
        progress_every_tokens: with kvckpt's agent loop and server (docs/integrations.md, "verl V1"), each
            in-flight sample's tokens are recorded once it has this many unrecorded ones (and at every weight-sync
            abort and at its end), so a crash regenerates at most this many tokens per sample; 0 turns it off.
    """

    path: str
    actor_name: str = "kvckpt_verl_ledger"
    progress_every_tokens: int = PROGRESS_EVERY_TOKENS

    @classmethod
    def from_sampler_kwargs(cls, sampler_kwargs: DictConfig | Mapping[str, Any] | None) -> LedgerSettings:
        """Read ``sampler_kwargs["kvckpt"]``.

        Raises:
            BadArgument: the section is missing, has unknown keys, or a value is not a non-empty string.
        """
        if isinstance(sampler_kwargs, DictConfig):
            sampler_kwargs = OmegaConf.to_container(sampler_kwargs, resolve=True)  # type: ignore[assignment]
        section = dict(sampler_kwargs or {}).get("kvckpt")
        section = dict(section) if isinstance(section, Mapping) else section
        if not isinstance(section, Mapping):
            raise BadArgument("the kvckpt verl buffer needs trainer.v1.sampler.sampler_kwargs.kvckpt.path "
                              "(the ledger file, on a local disk)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise BadArgument(f"unknown keys {unknown} in trainer.v1.sampler.sampler_kwargs.kvckpt; "
                              f"known: {sorted(known)}")
        every = section.pop("progress_every_tokens", PROGRESS_EVERY_TOKENS)
        if type(every) is not int or every < 0:
            raise BadArgument("trainer.v1.sampler.sampler_kwargs.kvckpt.progress_every_tokens must be an integer "
                              f">= 0, got {every!r}")
        for name, value in section.items():
            if not isinstance(value, str) or not value:
                raise BadArgument(f"trainer.v1.sampler.sampler_kwargs.kvckpt.{name} must be a non-empty string, "
                                  f"got {value!r}")
        if "path" not in section:
            raise BadArgument("trainer.v1.sampler.sampler_kwargs.kvckpt.path is required (the ledger file)")
        return cls(**section, progress_every_tokens=every)
