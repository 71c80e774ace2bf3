"""The four NeMo-RL samplers (``in_order``, ``weight_fifo``, ``windowed``, ``ready_first``) and
the registry custom samplers join. :func:`create_sampler` builds one from its config dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvckpt.errors import BadArgument
from kvckpt.samplers._in_order import InOrderSampler
from kvckpt.samplers._ready_first import ReadyFirstSampler
from kvckpt.samplers._weight_fifo import WeightFifoSampler
from kvckpt.samplers._windowed import WindowedSampler
from kvckpt.samplers.base import Sampler
from kvckpt.tables.view import BufferView

__all__ = ["BufferView", "InOrderSampler", "ReadyFirstSampler", "Sampler", "WeightFifoSampler",
           "WindowedSampler", "create_sampler", "register"]

_REGISTRY: dict[str, type[Sampler]] = {
    cls.name: cls for cls in (InOrderSampler, WeightFifoSampler, WindowedSampler, ReadyFirstSampler)
}


def register(cls: type[Sampler]) -> type[Sampler]:
    """Register a custom sampler class under ``cls.name`` (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise BadArgument(f"{cls!r} is not a Sampler subclass")
    _REGISTRY[cls.name] = cls
    return cls


def create_sampler(config: Sampler | str | Mapping[str, Any]) -> Sampler:
    """A sampler from an instance, a name, or a config dict ``{"name": ..., **keys}``.

    Raises:
        BadArgument: unknown name or unknown config key (the message lists the valid ones).
    """
    if isinstance(config, Sampler):
        return config
    cfg = {"name": config} if isinstance(config, str) else dict(config)
    name = cfg.pop("name", None)
    if name not in _REGISTRY:
        raise BadArgument(f"unknown sampler {name!r}; known: {sorted(_REGISTRY)} "
                          "(register custom ones with kvckpt.samplers.register)")
    try:
        return _REGISTRY[name](**cfg)
    except TypeError as exc:
        raise BadArgument(f"bad config for sampler {name!r}: {exc}") from None
