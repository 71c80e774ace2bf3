"""Shared fixture of the durability tests: ``crafted``, tests/_crafted.py's hostile files, built once a module."""

from __future__ import annotations

import _crafted
import pytest


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every crafted case of tests/_crafted.py and its bases, written under a fresh directory:
    ``{case name: file}`` (``_crafted.build_all``)."""
    return _crafted.build_all(str(tmp_path_factory.mktemp("crafted")))
