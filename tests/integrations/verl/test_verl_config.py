"""verl's ``trainer.v1.sampler.sampler_kwargs.kvckpt`` section goes through the integrations' one
config loader: an unknown key is refused naming it and the section, as verl hands it
(``trainer_base._build_replay_buffer`` passes ``sampler_kwargs`` as an OmegaConf ``DictConfig``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl")  # runs in .venv-verl (scripts/peer_envs/verl.txt)

from kvckpt.integrations.verl.config import LedgerSettings
from omegaconf import OmegaConf

from kvckpt.errors import BadArgument

pytestmark = pytest.mark.verl

SECTION = r"section trainer\.v1\.sampler\.sampler_kwargs\.kvckpt of verl's trainer config"


def test_verl_refuses_an_unknown_key_naming_its_section() -> None:
    kwargs = OmegaConf.create({"kvckpt": {"path": "/tmp/l.kv", "actor_nmae": "x"}})
    with pytest.raises(BadArgument, match=r"unknown config key\(s\) \['actor_nmae'\] in " + SECTION
                                          + r"; valid: \['actor_name', 'path', 'progress_every_tokens'\]"):
        LedgerSettings.from_sampler_kwargs(kwargs)


def test_verl_reads_its_section_and_refuses_what_it_cannot_use() -> None:
    assert LedgerSettings.from_sampler_kwargs(OmegaConf.create({"kvckpt": {"path": "/l.kv"}})) == \
        LedgerSettings("/l.kv", "kvckpt_verl_ledger")
    with pytest.raises(BadArgument, match=r"bad config in " + SECTION + r": missing config key\(s\) \['path'\]"):
        LedgerSettings.from_sampler_kwargs({"kvckpt": {"actor_name": "a"}})
    with pytest.raises(BadArgument, match=r"sampler_kwargs\.kvckpt\.actor_name must be a non-empty string"):
        LedgerSettings.from_sampler_kwargs({"kvckpt": {"path": "/l.kv", "actor_name": ""}})
    with pytest.raises(BadArgument, match=r"needs trainer\.v1\.sampler\.sampler_kwargs\.kvckpt\.path"):
        LedgerSettings.from_sampler_kwargs(None)
    with pytest.raises(BadArgument, match=r"sampler_kwargs\.kvckpt\.progress_every_tokens must be an integer >= 0"):
        LedgerSettings.from_sampler_kwargs({"kvckpt": {"path": "/l.kv", "progress_every_tokens": "64"}})
