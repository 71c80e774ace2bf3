"""NeMo-Gym 0.7.0's own token-capture conformance suite against kvckpt's store, unmodified (in .venv-gym).

Gym's ``run_conformance`` (``nemo_gym/token_id_capture/conformance.py``) is called exactly as its docstring
says a framework transport calls it: factories of fresh sink, source and lineage clients over one backend.
Then Gym's own config loader builds the store from the YAML block a user writes, and a SIGKILLed writer's
acknowledged puts are read back by a fresh process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gym

conformance = pytest.importorskip("nemo_gym.token_id_capture.conformance")
from kvckpt.integrations.nemo_gym import KvckptLineageStore, KvckptTokenStore  # noqa: E402
from nemo_gym.token_id_capture.config import TokenIdCaptureConfig  # noqa: E402

#: Gym 0.7.0's checks, in its order; ``begin_call_custody`` runs because the sink has ``begin_call``.
GYM_CHECKS = ["put_then_freeze_visibility", "idempotent_reput", "conflicting_reput", "mark_incomplete_durability",
              "freeze_idempotency", "post_freeze_write_safety", "conditional_retirement", "lineage_visibility",
              "fresh_client_lineage_visibility", "begin_call_custody"]


def test_gyms_own_conformance_suite_passes_all_ten_checks(tmp_path: Path) -> None:
    path = str(tmp_path / "gym_tokens.kv")
    passed = asyncio.run(conformance.run_conformance(lambda: KvckptTokenStore(path), lambda: KvckptTokenStore(path),
                                                     lambda: KvckptLineageStore(path)))
    assert passed == GYM_CHECKS


def test_gyms_config_block_builds_the_store(tmp_path: Path) -> None:
    path = str(tmp_path / "gym_tokens.kv")
    config = TokenIdCaptureConfig.model_validate({"token_id_capture": {
        "enabled": True, "sink": "kvckpt.integrations.nemo_gym:KvckptTokenStore", "sink_kwargs": {"path": path},
        "lineage_store": "kvckpt.integrations.nemo_gym:KvckptLineageStore", "lineage_store_kwargs": {"path": path}}})
    sink, lineage = config.build_sink(), config.build_lineage_store()
    assert isinstance(sink, KvckptTokenStore) and isinstance(lineage, KvckptLineageStore)
    assert not lineage.is_process_shared()
    asyncio.run(sink.close())
    asyncio.run(lineage.close())
    assert os.path.exists(path)


_WRITER = textwrap.dedent("""
    import asyncio, sys
    from kvckpt.integrations.nemo_gym import KvckptTokenStore
    from nemo_gym.token_id_capture.conformance import _make_entry, _REQUEST

    async def main():
        sink = KvckptTokenStore(sys.argv[1])
        for i in range(1000):
            await sink.put(_make_entry("r", f"call-{i}", prompt=[1, 2], generation=[3, i], request_items=_REQUEST,
                                       text=str(i)))
            print(i, flush=True)

    asyncio.run(main())
""")


def test_acknowledged_puts_survive_a_sigkill_read_by_a_fresh_process(tmp_path: Path) -> None:
    path = str(tmp_path / "gym_tokens.kv")
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, path], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert writer.stdout is not None
    acknowledged = [int(writer.stdout.readline()) for _ in range(20)]
    os.killpg(writer.pid, signal.SIGKILL)
    writer.wait()
    reader = textwrap.dedent("""
        import asyncio, sys
        from kvckpt.integrations.nemo_gym import KvckptTokenStore
        snap = asyncio.run(KvckptTokenStore(sys.argv[1]).freeze("r"))
        print(snap.incomplete, sorted(int(e.model_call_id.split("-")[1]) for e in snap.entries))
    """)
    out = subprocess.run([sys.executable, "-c", reader, path], capture_output=True, text=True, check=True).stdout
    incomplete, numbers = out.split(" ", 1)
    numbers = [int(n) for n in numbers.strip(" []\n").split(",")]
    assert incomplete == "False"
    assert numbers[:len(acknowledged)] == acknowledged  # every acknowledged put, in order
    assert numbers == list(range(len(numbers)))  # and nothing half-written: at most the put in flight beyond them
