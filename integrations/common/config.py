"""The one config loader integrations share: a YAML file or a dict section into a dataclass.

Every key is checked against the dataclass's fields, nested dataclass fields included: an unknown
key is a :class:`~kvckpt.errors.BadArgument` naming the key, where it sits and the file, so a typo
never silently falls back to a default. Integrations declare their config as a frozen dataclass
and call :func:`load_config`; :func:`check_keys` is the same refusal for configs that are not
dataclasses (NeMo-RL's key aliases).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from kvckpt.integrations.common.peer import require_peer

from kvckpt.errors import BadArgument

T = TypeVar("T")
Source = typing.Union[Mapping[str, Any], str, "os.PathLike[str]"]


def check_keys(doc: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Refuse any key of ``doc`` not in ``known``.

    Raises:
        BadArgument: ``"unknown config key(s) ['k'] in <where>; valid: [...]"``.
    """
    valid = sorted(known)
    unknown = sorted(set(doc) - set(valid))
    if unknown:
        raise BadArgument(f"unknown config key(s) {unknown} in {where}; valid: {valid}")


def read_document(source: Source) -> tuple[Mapping[str, Any], str | None]:
    """The mapping ``source`` holds and the file it came from (``None`` for a mapping).

    Raises:
        BadArgument: the file is not YAML (or JSON), or its top level is not a mapping.
        PeerMissing: a file is given and PyYAML is not installed.
        OSError: the file cannot be read (the error names it).
    """
    if isinstance(source, Mapping):
        return source, None
    path = os.fspath(source)
    yaml = require_peer("yaml", integration=f"reading the config file {path}", install="pip install pyyaml")
    with open(path) as fh:
        try:
            doc = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            raise BadArgument(f"config file {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if doc is None:
        return {}, path
    if not isinstance(doc, Mapping):
        raise BadArgument(f"config file {path} must hold a mapping of keys, not a {type(doc).__name__}")
    return doc, path


def load_config(cls: type[T], source: Source, *, section: str | None = None, within: str | None = None,
                origin: str | None = None, ignore: Iterable[str] = ()) -> T:
    """``cls`` (a dataclass) built from ``source``, a dict or a YAML/JSON file path.

    Args:
        cls: the config dataclass; fields whose type is a dataclass are read from a nested mapping
            the same way.
        source: the whole document (a mapping, or the path of a file holding one).
        section: a dotted key path inside the document (e.g. ``"async_rl.replay_buffer"``);
            ``None`` reads the whole document.
        within: where ``source`` itself sits in the user's config, when a peer hands over a section
            already cut out (TransferQueue's ``backend.kvckpt``): messages name the full path.
        origin: what to call a mapping ``source`` in messages (``"the TransferQueue config"``); a
            file is named by its path.
        ignore: keys the peer itself writes into the section, accepted and not read (only these).

    Raises:
        BadArgument: an unknown key (named with its section and file), a missing section, a
            section that is not a mapping, a missing required key, or what ``cls`` itself refuses.
    """
    doc, path_of_file = read_document(source)
    origin = path_of_file or origin
    path: tuple[str, ...] = tuple(within.split(".")) if within else ()
    for key in section.split(".") if section else ():
        path += (key,)
        doc = doc.get(key) if isinstance(doc, Mapping) else None
        if not isinstance(doc, Mapping):
            raise BadArgument(f"no config section {'.'.join(path)} (a mapping of keys) in {_where((), origin)}")
    skipped = frozenset(ignore)
    return _build(cls, {k: v for k, v in doc.items() if k not in skipped}, path, origin)


def _where(path: tuple[str, ...], origin: str | None) -> str:
    place = f"section {'.'.join(path)}" if path else "the top level"
    return f"{place} of {origin}" if origin else place


def _build(cls: type[T], doc: Mapping[str, Any], path: tuple[str, ...], origin: str | None) -> T:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"load_config needs a dataclass, got {cls!r}")
    where = _where(path, origin)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    check_keys(doc, fields, where)
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.init and f.name not in doc
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise BadArgument(f"bad config in {where}: missing config key(s) {missing}")
    try:
        hints = typing.get_type_hints(cls)
    except NameError:  # an annotation names a type only a function's scope knew: take what is a class
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in doc.items():
        sub = hints.get(name)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, Mapping):
                raise BadArgument(f"config section {'.'.join((*path, name))} must be a mapping of keys, got "
                                  f"{type(value).__name__} in {where}")
            value = _build(sub, value or {}, (*path, name), origin)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise BadArgument(f"bad config in {where}: {exc}") from None
