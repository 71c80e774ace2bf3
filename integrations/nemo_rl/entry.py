"""Run NeMo-RL's SingleController GRPO script with the kvckpt replay buffer, selected by config.

``python -m kvckpt.integrations.nemo_rl.entry --config grpo.yaml [key=value ...]``

1. :func:`build_master_config` reads the YAML as NeMo-RL's loader does (``defaults:``
   inheritance, then ``key=value`` / ``+key=value`` / ``~key`` overrides) into a plain dict,
   with OmegaConf only: no NeMo-RL needed, so a bad config is reported before anything starts.
2. :func:`~.config.from_master_config` reads its ``async_rl.replay_buffer`` section
   (``backend: kvckpt``, ``path``, ...); NeMo-RL's own keys stay where NeMo-RL reads them.
3. :func:`~.swap.install` puts the backend into NeMo-RL, then NeMo-RL's own
   ``examples/run_grpo_single_controller.py`` runs with the same arguments (``--nemo-rl-script``
   names another copy). NeMo-RL's models allow extra keys, so it ignores the new section.

Every refusal is a kvckpt error, printed as one line; the exit status is then 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvckpt.integrations.nemo_rl.config import AdapterConfig, from_master_config

from kvckpt.errors import BadArgument, KvckptError

#: NeMo-RL's SingleController launcher, relative to its source checkout.
SCRIPT = Path("examples") / "run_grpo_single_controller.py"


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> Any:
    from omegaconf import DictConfig, OmegaConf

    path = path.resolve()
    if path in seen:
        raise BadArgument(f"config {str(path)!r} inherits from itself through `defaults`")
    try:
        conf = OmegaConf.load(path)
    except (OSError, ValueError) as exc:
        raise BadArgument(f"cannot read config {str(path)!r}: {exc}") from None
    if not isinstance(conf, DictConfig):
        raise BadArgument(f"config {str(path)!r} is not a mapping")
    defaults = conf.pop("defaults", None)
    parents = [] if defaults is None else [defaults] if isinstance(defaults, str) else list(defaults)
    base = OmegaConf.create({})
    for parent in parents:
        base = OmegaConf.merge(base, _load_with_defaults(path.parent / str(parent), (*seen, path)))
    return OmegaConf.merge(base, conf)


def build_master_config(config_path: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The master config NeMo-RL's launcher would build from ``config_path`` and ``overrides``.

    Raises:
        BadArgument: an unreadable or non-mapping file, an inheritance cycle, or an override
            other than ``key=value``, ``+key=value`` or ``~key``.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    conf = _load_with_defaults(Path(config_path))
    for override in overrides:
        try:
            if override.startswith("~"):
                parent, _, leaf = override[1:].rpartition(".")
                node = OmegaConf.select(conf, parent) if parent else conf
                if node is None or leaf not in node:
                    raise BadArgument(f"override {override!r} deletes a key the config does not have")
                node.pop(leaf)
            elif "=" in override:
                conf = OmegaConf.merge(conf, OmegaConf.from_dotlist([override.removeprefix("+")]))
            else:
                raise BadArgument(f"override {override!r} is not key=value, +key=value or ~key")
        except OmegaConfBaseException as exc:
            raise BadArgument(f"override {override!r}: {exc}") from None
    try:
        return OmegaConf.to_container(conf, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise BadArgument(f"config {config_path!r} does not resolve: {exc}") from None


def nemo_rl_script(explicit: str | None) -> str:
    """The launcher to run: ``explicit``, else ``examples/run_grpo_single_controller.py`` of the
    source checkout NeMo-RL is installed from.

    Raises:
        PeerMissing: NeMo-RL is not importable. BadArgument: no launcher there (pass ``--nemo-rl-script``).
    """
    from kvckpt.integrations.common import peer_missing
    from kvckpt.integrations.nemo_rl.hooks import INSTALL_HINT, INTEGRATION

    if explicit is not None:
        if not os.path.isfile(explicit):
            raise BadArgument(f"--nemo-rl-script {explicit!r} is not a file")
        return explicit
    spec = importlib.util.find_spec("nemo_rl")
    if spec is None or spec.origin is None:
        raise peer_missing("nemo_rl", integration=INTEGRATION, install=INSTALL_HINT)
    script = Path(spec.origin).parent.parent / SCRIPT
    if not script.is_file():
        raise BadArgument(f"NeMo-RL at {str(Path(spec.origin).parent)!r} has no {str(SCRIPT)!r} beside it (not a "
                          "source checkout): pass --nemo-rl-script PATH")
    return str(script)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """``--config`` (required), ``--nemo-rl-script``, and the overrides NeMo-RL's launcher takes."""
    parser = argparse.ArgumentParser(prog="python -m kvckpt.integrations.nemo_rl.entry",
                                     description="NeMo-RL SingleController GRPO with the kvckpt replay buffer")
    parser.add_argument("--config", required=True, help="NeMo-RL YAML with an async_rl.replay_buffer section")
    parser.add_argument("--nemo-rl-script", default=None, help="NeMo-RL's run_grpo_single_controller.py")
    return parser.parse_known_args(list(argv))


def prepare(argv: Sequence[str]) -> tuple[AdapterConfig, str, list[str]]:
    """Everything before NeMo-RL runs: the store config, the launcher and its argv. The config is
    checked first, so a bad one is reported even without NeMo-RL.

    Raises:
        BadArgument: a bad config or override. PeerMissing: NeMo-RL is not importable.
    """
    args, overrides = parse_args(argv)
    master = build_master_config(args.config, overrides)
    store = from_master_config(master, origin=args.config)
    script = nemo_rl_script(args.nemo_rl_script)
    return store, script, [script, "--config", args.config, *overrides]


def main(argv: Sequence[str] | None = None) -> int:
    """Run NeMo-RL's launcher with the kvckpt backend; 2 (and one line on stderr) on a refusal."""
    try:
        store, script, script_argv = prepare(sys.argv[1:] if argv is None else argv)
        from kvckpt.integrations.nemo_rl.swap import install

        install(store)
    except KvckptError as exc:
        print(f"kvckpt: {exc}", file=sys.stderr)
        return 2
    print(f"kvckpt: replay buffer {store.path!r} ({store.buffer.sampler}), running {script}", flush=True)
    saved, sys.argv = sys.argv, script_argv
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
