"""NeMo-RL's modules, and the one hook every NeMo-RL process with a kvckpt buffer needs.

NeMo-RL ships the buffer to its ``SingleControllerActor`` (another Ray process): unpickling a
kvckpt ``TQReplayBuffer`` there calls :func:`install_if_importable`, so the actor's
``create_sampler`` is kvckpt's before the actor is constructed. :func:`nemo_rl_modules` names what
to install when NeMo-RL is missing. The full swap (three names) is :func:`~.swap.install`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kvckpt.integrations.common import require_peer
from kvckpt.integrations.nemo_rl.sampler import create_sampler
from kvckpt.integrations.nemo_rl.steps import StepDriver

SETUP_MODULE = "nemo_rl.algorithms.single_controller_utils.setup"
CONTROLLER_MODULE = "nemo_rl.algorithms.single_controller"
INTEGRATION = "kvckpt.integrations.nemo_rl (inside NeMo-RL's SingleController)"
#: What to install when NeMo-RL is missing (the PyPI ``nemo-rl`` is a name placeholder).
INSTALL_HINT = ("NVIDIA NeMo-RL with its SingleController (main, 2026-11 or later) from source: "
                "`git clone https://github.com/NVIDIA-NeMo/RL && uv pip install -e ./RL` "
                "(the PyPI package `nemo-rl` is a placeholder and does not provide it)")


def nemo_rl_modules() -> tuple[ModuleType, ModuleType]:
    """NeMo-RL's setup and controller modules.

    Raises:
        PeerMissing: either cannot be imported (naming which, and what to install).
    """
    setup, controller = (require_peer(name, integration=INTEGRATION, install=INSTALL_HINT)
                         for name in (SETUP_MODULE, CONTROLLER_MODULE))
    return setup, controller


def is_kvckpt_buffer(buffer: Any) -> bool:
    """Whether ``buffer`` is a kvckpt buffer (its samplers are driven by a :class:`~.steps.StepDriver`)."""
    return isinstance(getattr(buffer, "steps", None), StepDriver)


def install_sampler_factory(controller: ModuleType) -> None:
    """Make ``controller.create_sampler`` build kvckpt's sampler for a kvckpt buffer. Idempotent."""
    original = controller.create_sampler
    if getattr(original, "kvckpt_original", None) is not None:
        return

    def dispatching(buffer: Any, cfg: Any) -> Any:
        return create_sampler(buffer, cfg) if is_kvckpt_buffer(buffer) else original(buffer, cfg)

    dispatching.kvckpt_original = original  # type: ignore[attr-defined]
    controller.create_sampler = dispatching


def install_if_importable() -> bool:
    """:func:`install_sampler_factory` into NeMo-RL's controller if this process can import it
    (what unpickling a kvckpt buffer calls); returns whether it did."""
    try:
        controller = importlib.import_module(CONTROLLER_MODULE)
    except ImportError:
        return False
    install_sampler_factory(controller)
    return True
