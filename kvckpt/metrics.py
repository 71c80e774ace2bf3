"""A metrics hook: a buffer's :meth:`~kvckpt.ReplayBuffer.stats` (and any numbers of your own)
handed to the metrics system you already use.

:class:`MetricsHook` wraps a *sink*, any callable ``sink(metrics, step)`` taking a flat
``{name: float}`` dict. Each call flattens what it is given (nested dicts become ``a/b`` names;
only ints, floats and numpy/torch scalars are kept, booleans as 0/1; strings and lists are left
out), prefixes the names and passes them on. Ready sinks:

* :func:`tensorboard_sink` — a ``torch.utils.tensorboard.SummaryWriter`` (or anything with its
  ``add_scalar(tag, value, step)``);
* :func:`wandb_sink` — a W&B run (``wandb.init(...)``), or the module-level ``wandb.log`` when
  none is given (imported only then);
* :func:`logging_sink` — one line per call on a :mod:`logging` logger.

Examples:
    >>> seen = []
    >>> hook = MetricsHook(lambda metrics, step: seen.append((step, metrics)))
    >>> hook({"committed": 12, "ready": 3, "note": "text is dropped"}, step=5)["kvckpt/committed"]
    12.0
    >>> seen
    [(5, {'kvckpt/committed': 12.0, 'kvckpt/ready': 3.0})]

kvckpt imports nothing of TensorBoard or W&B itself; a hook never raises into the training loop
unless ``raise_errors=True`` (a failing sink is logged once on the ``kvckpt.metrics`` logger and
then skipped).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from kvckpt.errors import BadArgument

logger = logging.getLogger(__name__)

#: ``sink(metrics, step)``: what a :class:`MetricsHook` feeds.
Sink = Callable[[Mapping[str, float], int], None]


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a (nested) mapping as ``{prefix + "a/b": float}``; other leaves dropped."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, numbers.Real):  # bool included: 0.0 / 1.0
            out[name] = float(value)
        elif getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
            item = value.item()
            if isinstance(item, numbers.Real):
                out[name] = float(item)
    return out


class MetricsHook:
    """Feeds flattened, prefixed numbers to a sink; see the module docstring.

    Args:
        sink: called as ``sink(metrics, step)``.
        prefix: prepended to every name. Defaults to ``"kvckpt/"``.
        every: pass on only calls whose ``step`` is a multiple of this. Defaults to 1.
        raise_errors: let a failing sink's exception through. Defaults to False (log it once,
            then keep skipping that sink's errors silently).

    Raises:
        BadArgument: ``every`` below 1.
    """

    def __init__(self, sink: Sink, *, prefix: str = "kvckpt/", every: int = 1, raise_errors: bool = False) -> None:
        if every < 1:
            raise BadArgument(f"every must be >= 1, got {every}")
        self.sink, self.prefix, self.every, self.raise_errors = sink, prefix, every, raise_errors
        self._warned = False

    def __call__(self, stats: Mapping[str, Any], step: int, extra: Mapping[str, Any] | None = None,
                 extra_prefix: str = "train/") -> dict[str, float]:
        """Flatten ``stats`` (names under ``prefix``) and ``extra`` (under ``extra_prefix``), hand
        them to the sink for ``step``, and return them (empty when ``step`` is skipped)."""
        if step % self.every:
            return {}
        metrics = flatten(stats, self.prefix)
        if extra:
            metrics.update(flatten(extra, extra_prefix))
        try:
            self.sink(metrics, step)
        except Exception:
            if self.raise_errors:
                raise
            if not self._warned:
                self._warned = True
                logger.warning("metrics sink %r failed; its later failures are not logged", self.sink, exc_info=True)
        return metrics


def tensorboard_sink(writer: Any) -> Sink:
    """A sink writing each metric with ``writer.add_scalar(name, value, step)`` (a TensorBoard
    ``SummaryWriter``; flush and close it yourself)."""

    def sink(metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)

    return sink


def wandb_sink(run: Any = None) -> Sink:
    """A sink logging each call as one ``run.log(metrics, step=step)``; without ``run``, the
    ``wandb`` module's own (``wandb.init`` must have been called).

    Raises:
        BadArgument: no ``run`` given and W&B is not installed (``pip install wandb``).
    """
    if run is None:
        run = _import("wandb", "metrics to W&B need the wandb package: pip install wandb")

    def sink(metrics: Mapping[str, float], step: int) -> None:
        run.log(dict(metrics), step=step)

    return sink


def logging_sink(log: logging.Logger | None = None, level: int = logging.INFO) -> Sink:
    """A sink writing one ``step N: name=value ...`` line per call to ``log`` (default: the
    ``kvckpt.metrics`` logger)."""
    target = log or logger

    def sink(metrics: Mapping[str, float], step: int) -> None:
        target.log(level, "step %d: %s", step, " ".join(f"{k}={v:g}" for k, v in metrics.items()))

    return sink


def sink_from_config(tensorboard_dir: str | None = None, wandb_project: str | None = None) -> Sink | None:
    """The sink a config names: a ``SummaryWriter`` on ``tensorboard_dir`` and/or a W&B run of
    ``wandb_project`` (both fanned out when both are given); ``None`` when neither is.

    Raises:
        BadArgument: the named one is not installed (the message says what to install).
    """
    sinks: list[Sink] = []
    if tensorboard_dir:
        tb = _import("torch.utils.tensorboard", "metrics to TensorBoard need the tensorboard package: "
                                                "pip install tensorboard")
        sinks.append(tensorboard_sink(tb.SummaryWriter(tensorboard_dir)))
    if wandb_project:
        wandb = _import("wandb", "metrics to W&B need the wandb package: pip install wandb")
        sinks.append(wandb_sink(wandb.init(project=wandb_project)))
    if not sinks:
        return None
    if len(sinks) == 1:
        return sinks[0]

    def fan_out(metrics: Mapping[str, float], step: int) -> None:
        for sink in sinks:
            sink(metrics, step)

    return fan_out


def _import(module: str, message: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise BadArgument(message) from None
