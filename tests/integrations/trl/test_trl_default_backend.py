"""The TRL worker's changed default backend (CHANGELOG.md, 0.2.0): left out, it is ``"server"`` with a
FutureWarning for one release; passed, it is silent."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from kvckpt import BadArgument

pytestmark = [pytest.mark.trl,
              pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                                 reason="TRL not installed (pip install -e '.[test]' on Python >= 3.11)")]


def test_leaving_the_backend_out_warns_that_its_default_changed(tmp_path) -> None:
    from kvckpt.integrations.trl import KvckptRolloutWorker

    with pytest.warns(FutureWarning, match='default backend is "server" since kvckpt 0.2.0'), \
            pytest.raises(BadArgument, match="non-empty dataset"):
        KvckptRolloutWorker(str(tmp_path / "b.kv"), "model", [], [], None)


def test_naming_the_backend_gives_no_warning(tmp_path) -> None:
    from kvckpt.integrations.trl import KvckptRolloutWorker

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for backend in ("server", "transformers"):
            with pytest.raises(BadArgument, match="non-empty dataset"):
                KvckptRolloutWorker(str(tmp_path / "b.kv"), "model", [], [], None, backend=backend)
