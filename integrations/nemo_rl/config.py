"""NeMo-RL's replay-buffer config keys, read into a kvckpt :class:`~kvckpt.BufferConfig`.

A NeMo-RL user swaps the buffer by configuration: the keys are NeMo-RL's own
(``max_buffered_rollouts``, a ``sampler`` section discriminated by ``name`` with
``max_lookahead_versions`` / ``max_staleness_versions`` / ``sample_freshest_first``, and the GRPO
sizes ``num_generations_per_prompt`` / ``num_prompts_per_step``), plus ``path``, the store file.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvckpt.integrations.common import check_keys

from kvckpt import BufferConfig, codec
from kvckpt.errors import BadArgument

#: The row fields of NeMo-RL's GRPO rollouts (``record_to_train_batch``); token fields are jagged.
GRPO_SCHEMA: dict[str, tuple[str, str]] = {
    "input_ids": ("int64", "token"),
    "generation_logprobs": ("float32", "token"),
    "token_mask": ("int64", "token"),
    "sample_mask": ("float32", "row"),
    "total_reward": ("float32", "row"),
    "input_lengths": ("int64", "row"),
}

#: Keys :func:`parse_config` understands; anything else is refused so a typo never goes unnoticed.
KNOWN_KEYS = frozenset({
    "backend", "path", "num_generations_per_prompt", "group_size", "num_prompts_per_step", "groups_per_step",
    "max_buffered_rollouts", "sampler", "schema", "partition_id", "retain_consumed", "compression_level",
    "durable_checkpoints", "checkpoint_dir", "progress_every_tokens"})


def custom_sampler_class(target: Any) -> type:
    """The kvckpt :class:`~kvckpt.samplers.Sampler` subclass a ``"module:Class"`` target names
    (NeMo-RL's ``custom`` sampler ``target``), registered under its ``name``.

    Raises:
        BadArgument: not ``module:Class``, the import fails, the module has no such class, or the
            class is not a kvckpt ``Sampler`` subclass with its own ``name``.
    """
    from kvckpt import Sampler, register

    module_name, sep, class_name = str(target).partition(":")
    if not isinstance(target, str) or not sep or not module_name or not class_name:
        raise BadArgument(f"custom sampler target must be 'module:ClassName', got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BadArgument(f"custom sampler target {target!r}: cannot import {module_name!r} ({exc})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise BadArgument(f"custom sampler target {target!r}: module {module_name!r} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Sampler)) or cls.name == Sampler.name:
        raise BadArgument(f"custom sampler target {target!r} is not a kvckpt.samplers.Sampler subclass with its own "
                          "`name` (subclass it and implement eligible/evictable; see kvckpt/samplers/base.py)")
    return register(cls)


def sampler_config_dict(cfg: Any) -> dict[str, Any]:
    """A sampler config as a plain dict: a name, a mapping, or a pydantic model (NeMo-RL's
    ``SamplerConfig``, read through ``model_dump``). NeMo-RL's ``{name: custom, target:
    "module:Class", **keys}`` becomes ``{name: <the class's name>, **keys}`` once the class is
    imported, checked and registered (:func:`custom_sampler_class`).

    Raises:
        BadArgument: another type, or a custom target :func:`custom_sampler_class` refuses.
    """
    if isinstance(cfg, str):
        return {"name": cfg}
    if isinstance(cfg, Mapping):
        out = dict(cfg)
    elif hasattr(cfg, "model_dump"):
        out = dict(cfg.model_dump())
    else:
        raise BadArgument(f"a sampler config must be a name, a mapping or a pydantic model, got {type(cfg).__name__}")
    if out.get("name") == "custom":
        out.pop("name")
        if "target" not in out:
            raise BadArgument("a custom sampler config needs target: 'module:ClassName'")
        out = {"name": custom_sampler_class(out.pop("target")).name, **out}
    return out


@dataclass(frozen=True)
class AdapterConfig:
    """A parsed replay-buffer config: where the store lives, its :class:`BufferConfig`, and the
    TransferQueue-style partition name reported in batch metadata."""

    path: str
    buffer: BufferConfig
    partition_id: str = "rollout_data"
    checkpoint_dir: str | None = None
    #: the engine proxy's interval (:mod:`.engine`): a crash regenerates at most this many tokens per sequence;
    #: 0 (the default): no progress is recorded
    progress_every_tokens: int = 0


def parse_config(config: Mapping[str, Any], *, where: str = "the replay-buffer config") -> AdapterConfig:
    """Read NeMo-RL-style keys (see the module docstring) into an :class:`AdapterConfig`.

    Args:
        config: ``path`` (required); ``num_generations_per_prompt`` (or ``group_size``,
            required); ``num_prompts_per_step`` (or ``groups_per_step``, defaults to 1);
            ``max_buffered_rollouts`` (defaults to 64, NeMo-RL's default); ``sampler`` (a name or a
            ``{name: ..., **keys}`` section, defaults to ``in_order``, NeMo-RL's default; ``{name:
            custom, target: "module:Class", **keys}`` names a kvckpt ``Sampler`` subclass);
            ``schema`` (defaults to :data:`GRPO_SCHEMA`); ``partition_id`` (defaults to
            ``rollout_data``); ``backend`` (``kvckpt`` if given); ``checkpoint_dir`` (where
            ``state_dict`` writes its checkpoint files; defaults to ``<path>.checkpoints``);
            ``progress_every_tokens`` (the engine proxy's interval, 0: off, the default); and
            kvckpt's own ``retain_consumed``, ``compression_level``, ``durable_checkpoints``.
        where: the section and file ``config`` came from, for the unknown-key refusal (the
            integrations' one, :func:`~kvckpt.integrations.common.check_keys`).

    Raises:
        BadArgument: a missing required key, an unknown key, another backend, or a capacity below
            ``sampler.required_buffer_capacity(num_prompts_per_step)`` (NeMo-RL refuses it too:
            the rollout pump would deadlock).
    """
    check_keys(config, KNOWN_KEYS, where)
    if config.get("backend", "kvckpt") != "kvckpt":
        raise BadArgument(f"this adapter is the kvckpt backend, not {config['backend']!r}")
    if not config.get("path"):
        raise BadArgument("the kvckpt replay buffer needs `path`, the store file (on a local disk)")
    group_size = config.get("num_generations_per_prompt", config.get("group_size"))
    if group_size is None:
        raise BadArgument("the kvckpt replay buffer needs num_generations_per_prompt (rows per group)")
    buffer = BufferConfig(
        group_size=group_size, schema=dict(config.get("schema", GRPO_SCHEMA)),
        sampler=sampler_config_dict(config.get("sampler", "in_order")),
        max_buffered_rollouts=config.get("max_buffered_rollouts", 64),
        groups_per_step=config.get("num_prompts_per_step", config.get("groups_per_step", 1)),
        retain_consumed=bool(config.get("retain_consumed", False)),
        compression_level=config.get("compression_level", codec.DEFAULT_LEVEL),
        durable_checkpoints=config.get("durable_checkpoints", 2))
    every = config.get("progress_every_tokens", 0)
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise BadArgument(f"progress_every_tokens must be an integer >= 0 (0: off), got {every!r}")
    return AdapterConfig(str(config["path"]), buffer, str(config.get("partition_id", "rollout_data")),
                         config.get("checkpoint_dir"), every)


def _section(config: Any, key: str) -> Any:
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return value.model_dump() if hasattr(value, "model_dump") else value


def from_master_config(master_config: Any, origin: str | None = None) -> AdapterConfig:
    """The kvckpt buffer a NeMo-RL master config selects with an ``async_rl.replay_buffer`` section.

    NeMo-RL's own keys are read where NeMo-RL keeps them: ``async_rl.sampler``,
    ``async_rl.max_buffered_rollouts``, ``grpo.num_generations_per_prompt`` and
    ``grpo.num_prompts_per_step``; ``async_rl.replay_buffer`` holds ``backend: kvckpt``, ``path``
    and any other :func:`parse_config` key (which then wins). Dicts and pydantic models both work.
    ``origin`` names the file the master config was read from, for messages.

    Raises:
        BadArgument: no ``async_rl.replay_buffer`` section, another backend, or what
            :func:`parse_config` refuses.
    """
    async_rl = _section(master_config, "async_rl") or {}
    section = _section(async_rl, "replay_buffer")
    if not isinstance(section, Mapping):
        raise BadArgument("the master config has no async_rl.replay_buffer section selecting the kvckpt backend")
    grpo = _section(master_config, "grpo") or {}
    merged: dict[str, Any] = {}
    for key, source, name in (("sampler", async_rl, "sampler"),
                              ("max_buffered_rollouts", async_rl, "max_buffered_rollouts"),
                              ("num_generations_per_prompt", grpo, "num_generations_per_prompt"),
                              ("num_prompts_per_step", grpo, "num_prompts_per_step")):
        value = _section(source, name)
        if value is not None:
            merged[key] = value
    return parse_config({**merged, **section},
                        where=f"section async_rl.replay_buffer of {origin or 'the master config'}")


_configured: list[AdapterConfig] = []


def configure(config: Any) -> AdapterConfig:
    """Set the config a ``TQReplayBuffer(dp_client, partition_id=..., pad_value_dict=...)`` built
    without one uses (what NeMo-RL's ``setup.py`` calls): a master config (see
    :func:`from_master_config`), a :func:`parse_config` dict, or an :class:`AdapterConfig`.
    Returns the parsed config."""
    if isinstance(config, AdapterConfig):
        parsed = config
    elif isinstance(config, Mapping) and "path" in config:
        parsed = parse_config(config)
    else:
        parsed = from_master_config(config)
    _configured[:] = [parsed]
    return parsed


def configured() -> AdapterConfig:
    """The config :func:`configure` set.

    Raises:
        BadArgument: :func:`configure` was not called in this process.
    """
    if not _configured:
        raise BadArgument("TQReplayBuffer was built without a kvckpt config: pass config=... or call "
                          "kvckpt.integrations.nemo_rl.configure(master_config) first")
    return _configured[0]
