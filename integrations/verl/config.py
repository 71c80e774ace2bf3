"""The one config section the kvckpt verl buffer reads: ``trainer.v1.sampler.sampler_kwargs.kvckpt``.

verl hands its custom sampler ``sampler_kwargs`` unchanged (``trainer_base._build_replay_buffer``),
so the ledger's settings live there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvckpt.integrations.common import load_config
from omegaconf import DictConfig, OmegaConf

from kvckpt.errors import BadArgument

#: Where the section sits in verl's trainer config.
SECTION = "trainer.v1.sampler.sampler_kwargs.kvckpt"

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

    def __post_init__(self) -> None:
        for name in ("path", "actor_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise BadArgument(f"{SECTION}.{name} must be a non-empty string, got {value!r}")
        every = self.progress_every_tokens
        if type(every) is not int or every < 0:
            raise BadArgument(f"{SECTION}.progress_every_tokens must be an integer >= 0, got {every!r}")

    @classmethod
    def from_sampler_kwargs(cls, sampler_kwargs: DictConfig | Mapping[str, Any] | None) -> LedgerSettings:
        """Read ``sampler_kwargs["kvckpt"]`` through the integrations' one loader
        (:func:`~kvckpt.integrations.common.load_config`).

        Raises:
            BadArgument: the section is missing, has unknown keys (each named with the section),
                lacks ``path``, or a value is not a non-empty string.
        """
        if isinstance(sampler_kwargs, DictConfig):
            sampler_kwargs = OmegaConf.to_container(sampler_kwargs, resolve=True)  # type: ignore[assignment]
        if not isinstance(dict(sampler_kwargs or {}).get("kvckpt"), Mapping):
            raise BadArgument(f"the kvckpt verl buffer needs {SECTION}.path (the ledger file, on a local disk)")
        return load_config(cls, sampler_kwargs, section="kvckpt", within=SECTION.rpartition(".")[0],
                           origin="verl's trainer config")
