"""What every integration shares (``kvckpt.integrations.common``) and the peer venv specs.

The peer-missing error and the config loader are asserted on real imports and real YAML files;
each ``scripts/peer_envs/*.txt`` is checked for what ``make test`` reads from it.
"""

from __future__ import annotations

import importlib.util
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _paths import ROOT
from kvckpt.integrations.common import PeerMissing, check_keys, load_config, require_peer
from kvckpt.reference.config import TrainerConfig

from kvckpt.errors import BadArgument, KvckptError


def test_a_missing_peer_is_one_line_naming_the_integration_and_the_command() -> None:
    with pytest.raises(PeerMissing) as info:
        require_peer("kvckpt_no_such_peer", integration="kvckpt.integrations.demo",
                     install="pip install 'kvckpt[demo]'")
    assert str(info.value) == "kvckpt.integrations.demo needs kvckpt_no_such_peer: pip install 'kvckpt[demo]'"
    assert isinstance(info.value, KvckptError) and isinstance(info.value, ModuleNotFoundError)
    assert info.value.name == "kvckpt_no_such_peer"
    again = pickle.loads(pickle.dumps(info.value))  # crosses Ray process boundaries intact
    assert (type(again), str(again), again.name) == (PeerMissing, str(info.value), "kvckpt_no_such_peer")


def test_a_peer_that_is_there_but_broken_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvckpt_broken_peer.py").write_text("import kvckpt_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PeerMissing, match=r"needs kvckpt_broken_peer: pip install x \(importing it failed: "
                                          r"No module named 'kvckpt_missing_dependency'\)$"):
        require_peer("kvckpt_broken_peer", integration="i", install="pip install x")
    assert require_peer("json", integration="i", install="-") is sys.modules["json"]


@pytest.mark.parametrize(("package", "peer", "command"), [
    ("kvckpt.integrations.ray", "ray", "pip install 'kvckpt[ray]'"),
    ("kvckpt.integrations.transferqueue", "transfer_queue", "pip install 'kvckpt[tq]'"),
    ("kvckpt.integrations.verl", "verl", "pip install 'kvckpt[verl]'"),
    ("kvckpt.integrations.nemo_gym", "nemo_gym", "pip install 'kvckpt[gym]'")])
def test_the_integrations_refuse_a_missing_peer_through_it(package: str, peer: str, command: str) -> None:
    # A fresh interpreter where the peer cannot be imported (a None entry in sys.modules).
    code = (f"import sys; sys.modules[{peer!r}] = None\n"
            f"from kvckpt.integrations.common import PeerMissing\n"
            f"try:\n    import {package}\nexcept PeerMissing as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"{package} needs {peer}: {command}"), out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_backend_refuses_a_missing_vllm_through_it() -> None:
    from kvckpt.integrations.vllm.worker import create_backend

    with pytest.raises(PeerMissing, match=r"^the vllm generation backend needs vllm: bash scripts/setup_peer_env\.sh "
                                          r"vllm, then use \.venv-vllm/bin/python"):
        create_backend("vllm", "unused-model-path")


@pytest.mark.skipif(importlib.util.find_spec("nemo_rl") is not None, reason="NeMo-RL is installed here")
def test_nemo_rl_hooks_refuse_a_missing_nemo_rl_through_it() -> None:
    from kvckpt.integrations.nemo_rl.hooks import nemo_rl_modules

    with pytest.raises(PeerMissing, match=r"^kvckpt\.integrations\.nemo_rl \(inside NeMo-RL's SingleController\) "
                                          r"needs nemo_rl\.algorithms\.single_controller_utils\.setup: "
                                          r".*does not provide it\)$"):
        nemo_rl_modules()


@dataclass(frozen=True)
class Inner:
    depth: int = 1


@dataclass(frozen=True)
class Outer:
    path: str
    inner: Inner = field(default_factory=Inner)
    tags: tuple[str, ...] = ()


def test_the_loader_reads_a_yaml_section_into_a_frozen_dataclass(tmp_path: Path) -> None:
    file = tmp_path / "run.yaml"
    file.write_text("trainer: {steps: 3}\nkvckpt:\n  path: /x.kv\n  inner: {depth: 4}\n")
    assert load_config(Outer, file, section="kvckpt") == Outer("/x.kv", Inner(4))
    assert load_config(Outer, {"a": {"b": {"path": "p"}}}, section="a.b") == Outer("p")
    assert load_config(Outer, {"path": "p", "inner": None}) == Outer("p")


@pytest.mark.parametrize(("text", "section", "message"), [
    ("kvckpt: {path: p, pth: q}\n", "kvckpt", r"unknown config key\(s\) \['pth'\] in section kvckpt of .*run\.yaml; "
                                              r"valid: \['inner', 'path', 'tags'\]"),
    ("kvckpt: {path: p, inner: {dpth: 2}}\n", "kvckpt", r"\['dpth'\] in section kvckpt\.inner of .*run\.yaml"),
    ("kvckpt: {path: p, inner: 3}\n", "kvckpt", r"section kvckpt\.inner must be a mapping"),
    ("other: {}\n", "kvckpt", r"no config section kvckpt \(a mapping of keys\) in the top level of .*run\.yaml"),
    ("kvckpt: {inner: {}}\n", "kvckpt", r"bad config in section kvckpt of .*run\.yaml: .*'path'"),
    ("- a list\n", None, r"must hold a mapping of keys, not a list"),
    ("kvckpt: [unclosed\n", None, r"run\.yaml is not valid YAML")])
def test_the_loader_refuses_with_the_key_and_the_file(tmp_path: Path, text: str, section: str | None,
                                                      message: str) -> None:
    file = tmp_path / "run.yaml"
    file.write_text(text)
    with pytest.raises(BadArgument, match=message):
        load_config(Outer, file, section=section)


def test_check_keys_and_the_trainer_config_share_the_refusal(tmp_path: Path) -> None:
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['b'\] in here; valid: \['a'\]"):
        check_keys({"a": 1, "b": 2}, {"a"}, "here")
    file = tmp_path / "t.yaml"
    file.write_text(f"output_dir: {tmp_path}\ngeneration: {{group_sise: 4}}\n")
    with pytest.raises(BadArgument, match=r"\['group_sise'\] in section generation of .*t\.yaml"):
        TrainerConfig.from_any(file)
    file.write_text(f"output_dir: {tmp_path}\ngeneration: {{group_size: 4}}\n")
    assert TrainerConfig.from_any(file).generation.group_size == 4


def _specs() -> list[Path]:
    return sorted((ROOT / "scripts" / "peer_envs").glob("*.txt"))


def test_there_is_a_peer_env_spec() -> None:
    assert "vllm" in [spec.stem for spec in _specs()]


@pytest.mark.parametrize("spec", _specs(), ids=lambda p: p.stem)
def test_each_peer_env_declares_what_make_test_reads(spec: Path) -> None:
    headers = dict(re.findall(r"^# (python|marker|tests|uninstall|import): *(.*)$", spec.read_text(), re.M))
    assert headers.get("python", "").startswith("python3"), "needs `# python: python3.X`"
    assert re.fullmatch(r"[a-z_][a-z0-9_]*", headers.get("marker", "")), "needs `# marker: NAME`"
    tests = headers.get("tests", "").split()
    assert tests and all((ROOT / t).is_file() for t in tests), f"`# tests:` names missing files: {tests}"
    registered = re.findall(r'^\s*"([a-z0-9_]+):', (ROOT / "pyproject.toml").read_text(), re.M)
    assert headers["marker"] in registered, \
        f"register the marker {headers['marker']!r} in pyproject.toml's [tool.pytest.ini_options] markers"
    marked = [t for t in tests if f"pytest.mark.{headers['marker']}" in (ROOT / t).read_text()]
    assert marked, f"none of {tests} carries @pytest.mark.{headers['marker']}: `make test` would run nothing there"
