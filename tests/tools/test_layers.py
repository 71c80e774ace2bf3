"""The core's layering, checked from the code's own imports (``python scripts/layers.py`` prints it).

Each rule is asserted on the real tree, and each is shown to catch a synthetic tree that breaks it,
so none of these checks can pass by being unable to fail.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
from _paths import ROOT

_spec = importlib.util.spec_from_file_location("kvckpt_layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
sys.modules["kvckpt_layers"] = layers
_spec.loader.exec_module(layers)


@pytest.fixture(scope="module")
def problems() -> list[str]:
    return layers.violations(layers.discover())


@pytest.mark.parametrize("rule", ["layer", "cycle", "private", "size", "boundary"])
def test_the_tree_keeps_the_rule(problems: list[str], rule: str) -> None:
    broken = [p for p in problems if p.startswith(f"{rule}:")]
    assert not broken, "\n".join(broken)


def test_every_module_has_a_layer() -> None:
    modules = layers.discover()
    assert len(modules) > 60
    assert all(m.layer >= 0 for m in modules.values()), [m.name for m in modules.values() if m.layer < 0]
    assert modules["kvckpt.storage.store"].layer < modules["kvckpt.tables.access"].layer \
        < modules["kvckpt.transitions.commit"].layer < modules["kvckpt.durability.recovery"].layer \
        < modules["kvckpt.buffer.replay_buffer"].layer < modules["kvckpt.tools.inspect"].layer
    # the value store is a core store kind: its records beside the replay buffer's tables, its facade a buffer
    assert modules["kvckpt.values.records"].layer == modules["kvckpt.tables.access"].layer
    assert modules["kvckpt.buffer.values"].layer == modules["kvckpt.buffer.replay_buffer"].layer


def _tree(tmp_path: Path, files: dict[str, str]) -> list[str]:
    for name, text in files.items():
        path = tmp_path / "kvckpt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in {p.parent for p in (tmp_path / "kvckpt").rglob("*.py")}:
        (folder / "__init__.py").touch()
    return layers.violations(layers.discover({"kvckpt": tmp_path / "kvckpt"}))


def test_an_upward_import_is_caught_even_inside_a_function(tmp_path: Path) -> None:
    found = _tree(tmp_path, {"storage/store.py": "def f():\n    from kvckpt.buffer import replay_buffer\n",
                             "buffer/replay_buffer.py": "X = 1\n"})
    assert found == ["layer: kvckpt.storage.store (storage) imports kvckpt.buffer.replay_buffer (buffer)"]


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    found = _tree(tmp_path, {"tables/a.py": "from kvckpt.tables import b\n",
                             "tables/b.py": "from kvckpt.tables.a import X\n"})
    assert found == ["cycle: kvckpt.tables.a -> kvckpt.tables.b"]


def test_a_reach_into_privates_is_caught(tmp_path: Path) -> None:
    found = _tree(tmp_path, {
        "tables/a.py": "def _helper():\n    pass\n\nclass A:\n    def __init__(self):\n        self._mine = 1\n",
        "tables/b.py": """
            from kvckpt.tables import a
            from kvckpt.tables.a import _helper

            def f(obj):
                return a._helper, obj._theirs, obj._asdict()
            """})
    assert sorted(found) == ["private: kvckpt.tables.b reaches a._helper (line 6)",
                             "private: kvckpt.tables.b reaches from kvckpt.tables.a import _helper",
                             "private: kvckpt.tables.b reaches obj._theirs (line 6)"]


def test_a_long_module_must_say_why(tmp_path: Path) -> None:
    body = "X = 1\n" * (layers.MAX_LINES + 1)
    found = _tree(tmp_path, {"storage/big.py": '"""Big."""\n' + body,
                             "storage/ok.py": '"""Big, and long because it must be."""\n' + body})
    assert found == [f"size: kvckpt.storage.big has {layers.MAX_LINES + 2} lines and its docstring does not say why"]


def test_the_boundary_rule_covers_every_integration() -> None:
    modules = layers.discover()
    consumers = [m for m in modules if m.startswith(layers.CONSUMERS)]
    assert len(consumers) > 40 and "kvckpt.integrations.transferqueue.client" in consumers
    # the reference trainer is a user of kvckpt and its integrations: above them, and held to the public API too
    assert "kvckpt.reference.grpo" in consumers
    assert modules["kvckpt.reference.grpo"].layer > modules["kvckpt.integrations.vllm.worker"].layer
    # the public API is what kvckpt exports, read from its __all__: the adapters' durable-dir helpers included
    assert {"ReplayBuffer", "ValueStore", "makedirs_durable", "fsync_dir", "write_id_of"} <= modules["kvckpt"].exports


def test_an_integration_reaching_past_the_public_api_is_caught(tmp_path: Path) -> None:
    """An integration may import what ``kvckpt`` exports, the public packages and other integrations;
    a layer-internal module (even for a name kvckpt also exports), an unexported name or a private
    one is refused, however it is spelt."""
    (tmp_path / "integrations" / "peer").mkdir(parents=True)
    (tmp_path / "integrations" / "__init__.py").touch()
    (tmp_path / "integrations" / "peer" / "__init__.py").touch()
    (tmp_path / "integrations" / "peer" / "adapter.py").write_text(textwrap.dedent("""
        import kvckpt
        import kvckpt.storage.store
        from kvckpt import ReplayBuffer, Store, _hidden
        from kvckpt.errors import BadArgument
        from kvckpt.integrations.peer import helper
        from kvckpt.samplers import register
        from kvckpt.storage.store import fsync_dir
        from kvckpt.testing import workload

        def f():
            from kvckpt.tables.records import READY
            return kvckpt.ReplayBuffer, kvckpt.tables.records.READY, kvckpt.errors.BadArgument
        """))
    (tmp_path / "integrations" / "peer" / "helper.py").write_text("X = 1\n")
    files = {"__init__.py": '__all__ = ["ReplayBuffer", "Store"]\nReplayBuffer = Store = _hidden = 1\n',
             "errors.py": "class BadArgument(Exception):\n    pass\n", "samplers/__init__.py": "def register(): ...\n",
             "storage/store.py": "def fsync_dir(): ...\n", "tables/records.py": "READY = 'ready'\n",
             "testing/workload.py": "X = 1\n"}
    for name, text in files.items():
        (tmp_path / "kvckpt" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "kvckpt" / name).write_text(text)
    found = layers.violations(layers.discover({"kvckpt": tmp_path / "kvckpt",
                                               "kvckpt.integrations": tmp_path / "integrations"}))
    prefix = "boundary: kvckpt.integrations.peer.adapter reaches past the public API: "
    assert sorted(p.removeprefix(prefix) for p in found if p.startswith("boundary:")) == [
        "from kvckpt import _hidden",
        "from kvckpt.storage.store import fsync_dir",
        "from kvckpt.tables.records import READY",
        "kvckpt.storage.store (line 3)",
        "kvckpt.tables.records.READY (line 13)",
    ]
    # the same imports in a core module are no boundary matter (the layer rules judge them)
    assert all(not p.startswith("boundary: kvckpt.storage") for p in found)


def test_a_tool_or_benchmark_reaching_below_its_face_is_caught(tmp_path: Path) -> None:
    """The tools and the benchmarks may import the public API, the consumers and the tools' face
    (``kvckpt.tooling``); a module below it or a private name is refused. An integration may not use the face."""
    files = {"kvckpt/__init__.py": '__all__ = ["Store"]\nStore = 1\n',
             "kvckpt/tooling.py": "from kvckpt.storage import codec\n",
             "kvckpt/storage/codec.py": "def _encode_field(): ...\ndef encode(): ...\n",
             "tools/__init__.py": "", "tools/inspect.py": textwrap.dedent("""
                 from kvckpt import Store
                 from kvckpt.tooling import codec
                 from kvckpt.storage.codec import encode
                 """),
             "benchmarks/__init__.py": "", "benchmarks/codec_bench.py": textwrap.dedent("""
                 from kvckpt.tooling import codec
                 from kvckpt.tools.inspect import Store
                 from kvckpt.storage import codec as raw
                 codec._encode_field()
                 """),
             "integrations/__init__.py": "", "integrations/peer.py": "from kvckpt.tooling import codec\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = layers.violations(layers.discover({"kvckpt": tmp_path / "kvckpt", "kvckpt.tools": tmp_path / "tools",
                                               "kvckpt.integrations": tmp_path / "integrations",
                                               "benchmarks": tmp_path / "benchmarks"}))
    reaches = sorted(p.split(": ", 1)[1] for p in found if p.startswith(("boundary:", "private:")))
    assert reaches == [
        "benchmarks.codec_bench reaches codec._encode_field (line 5)",
        "benchmarks.codec_bench reaches past the public API: from kvckpt.storage import codec",
        "kvckpt.integrations.peer reaches past the public API: from kvckpt.tooling import codec",
        "kvckpt.tools.inspect reaches past the public API: from kvckpt.storage.codec import encode",
    ], found
