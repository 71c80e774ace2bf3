"""Every integration's config goes through the one loader (``kvckpt.integrations.common``): an
unknown key is a ``BadArgument`` naming the key, its section and where the config came from (the
file, or the peer's config the section was cut from). The configs are built the way each peer
builds them: TransferQueue's section from an OmegaConf YAML handed to its client and bootstrap,
NeMo-RL's master config through the launcher entry, the reference trainer's YAML file. verl's
section is asserted in ``tests/integrations/verl/test_verl_config.py`` (its own venv).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvckpt.integrations.nemo_rl.entry import prepare
from kvckpt.integrations.transferqueue.backend import start_value_store
from kvckpt.integrations.transferqueue.client import BackendSettings, KvckptStorageClient
from kvckpt.reference.config import TrainerConfig
from omegaconf import OmegaConf

from kvckpt.errors import BadArgument

TQ_SECTION = r"in section backend\.kvckpt of the TransferQueue config; valid: \['actor_name', 'compression_level', "


def _tq_config(tmp_path: Path, extra: str) -> object:
    file = tmp_path / "tq.yaml"
    file.write_text(f"backend:\n  storage_backend: kvckpt\n  kvckpt:\n    path: {tmp_path / 'v.kv'}\n"
                    f"    owner: process\n{extra}")
    return OmegaConf.load(file)


def test_transferqueue_refuses_an_unknown_key_in_its_client_and_its_bootstrap(tmp_path: Path) -> None:
    conf = _tq_config(tmp_path, "    compresion_level: 3\n")
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['compresion_level'\] " + TQ_SECTION):
        KvckptStorageClient(conf.backend.kvckpt)  # as TransferQueue's StorageClientFactory builds it
    with pytest.raises(BadArgument, match=r"\['compresion_level'\] " + TQ_SECTION):
        start_value_store(conf)  # tq.init's bootstrap hook: refused before any actor starts
    assert not (tmp_path / "v.kv").exists()


def test_transferqueue_lets_through_only_the_keys_it_writes_itself(tmp_path: Path) -> None:
    conf = _tq_config(tmp_path, "    client_name: KvckptStorageClient\n")
    settings = BackendSettings.from_config(conf.backend.kvckpt)
    assert (settings.owner, settings.compression_level) == ("process", 0)
    with pytest.raises(BadArgument, match=r"needs backend\.kvckpt\.path"):
        BackendSettings.from_config({"owner": "actor"})
    with pytest.raises(BadArgument, match=r"backend\.kvckpt\.compression_level must be 0\.\."):
        BackendSettings.from_config({"path": "x", "compression_level": True})


def test_nemo_rl_refuses_an_unknown_key_naming_its_section_and_file(tmp_path: Path) -> None:
    file = tmp_path / "grpo.yaml"
    file.write_text(f"grpo: {{num_generations_per_prompt: 2, num_prompts_per_step: 1}}\nasync_rl:\n  replay_buffer: "
                    f"{{backend: kvckpt, path: {tmp_path / 'r.kv'}, retian_consumed: true}}\n")
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['retian_consumed'\] in section "
                                          r"async_rl\.replay_buffer of .*grpo\.yaml; valid: \["):
        prepare(["--config", str(file)])


def test_the_reference_trainer_refuses_an_unknown_key_naming_its_section_and_file(tmp_path: Path) -> None:
    file = tmp_path / "t.yaml"
    file.write_text(f"output_dir: {tmp_path}\ncheckpoint: {{evry: 3}}\n")
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['evry'\] in section checkpoint of .*t\.yaml"):
        TrainerConfig.from_any(file)
