"""The kvckpt storage backend of TransferQueue 0.1.11, with the real ``transfer_queue`` package.

The first half drives the backend's own objects on real store files (no Ray): write identities,
recycled keys, identity-checked clears, refusals, and the storage checkpoint file. The second half
runs TransferQueue itself on a loopback-only Ray (``tq.init`` with ``backend.storage_backend:
kvckpt``): the ``kv_*`` API, a recycled global index served only with its own bytes, and
``tq.save_checkpoint`` -> ``tq.load_checkpoint`` in a fresh process with the tensors coming back
equal. Skipped when TransferQueue (``pip install 'kvckpt[tq]'``) is not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from _paths import child_env

pytest.importorskip("transfer_queue")
kray = pytest.importorskip("kvckpt.integrations.ray")  # before ray: keeps Ray on loopback

import kvckpt.integrations.transferqueue as ktq  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from kvckpt.errors import BadArgument, CorruptRecord, FormatError, RecoveryError  # noqa: E402

pytestmark = pytest.mark.ray
PARTITION = "train"


def client_for(path: str) -> ktq.KvckptStorageClient:
    """A backend client that owns ``path`` in this process (no Ray needed)."""
    return ktq.KvckptStorageClient({"path": path, "owner": "process"})


def tensors(seed: int) -> dict[str, Any]:
    """Values of one sample, one per field kind TransferQueue hands a KV backend."""
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50_000, (3 + seed % 5,), generator=gen),
            "logprobs": -torch.rand(3 + seed % 5, generator=gen),
            "reward": torch.rand((), generator=gen),
            "hidden": torch.randn(4, generator=gen).to(torch.bfloat16),
            "text": {"prompt": f"q{seed}", "tags": [seed, "x"]}}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


# -- the backend's objects, without Ray --------------------------------------------------------------
def test_put_returns_one_write_identity_per_key_and_get_verifies_it(tmp_path: Any) -> None:
    client = client_for(str(tmp_path / "v.kv"))
    sample = tensors(1)
    keys = [f"0@{f}" for f in sample]
    ids = client.put(keys, list(sample.values()))
    assert len(ids) == 5 and len(set(ids)) == 1 and len(ids[0]) == 16
    got = client.get(keys, custom_backend_meta=ids)
    assert all(equal(g, v) for g, v in zip(got, sample.values(), strict=True))
    assert got[3].dtype == torch.bfloat16 and got[4] == {"prompt": "q1", "tags": [1, "x"]}
    assert client.put(keys[:1], [sample["input_ids"]]) != ids[:1]  # every put is a new write
    assert client.count() == 5
    client.close()


def test_a_recycled_key_is_served_only_with_its_own_bytes(tmp_path: Any) -> None:
    client = client_for(str(tmp_path / "v.kv"))
    [old] = client.put(["7@input_ids"], [torch.tensor([1, 2, 3])])
    assert client.clear(["7@input_ids"], [old]) == 1
    [new] = client.put(["7@input_ids"], [torch.tensor([9, 9])])  # index 7 reused by another sample
    with pytest.raises(ktq.WriteIdentityMismatch) as err:
        client.get(["7@input_ids"], custom_backend_meta=[old])
    assert (err.value.key, err.value.expected, err.value.found) == ("7@input_ids", old, new)
    assert "refusing to serve another sample's bytes" in str(err.value)
    with pytest.raises(ktq.WriteIdentityMismatch):
        client.get(["7@input_ids"], custom_backend_meta=[None])  # no identity: never served blind
    assert torch.equal(client.get(["7@input_ids"], custom_backend_meta=[new])[0], torch.tensor([9, 9]))
    client.close()


def test_a_clear_from_stale_metadata_keeps_the_newer_write(tmp_path: Any) -> None:
    client = client_for(str(tmp_path / "v.kv"))
    [old] = client.put(["3@f"], [torch.tensor([1.0])])
    [new] = client.put(["3@f"], [torch.tensor([2.0])])
    assert client.clear(["3@f", "4@f"], [old, None]) == 0
    assert client.get(["3@f"], custom_backend_meta=[new])[0].item() == 2.0
    assert client.clear(["3@f"], [new]) == 1 and client.count() == 0
    client.close()


def test_missing_corrupt_and_unstorable_values_are_refused(tmp_path: Any) -> None:
    client = client_for(str(tmp_path / "v.kv"))
    ids = client.put(["0@a", "1@a"], [torch.ones(3), torch.zeros(2)])
    with pytest.raises(ktq.ValueMissing, match="'2@a' is not in the kvckpt store"):
        client.get(["0@a", "2@a"], custom_backend_meta=[ids[0], ids[0]])
    store = client._owner._store
    raw = bytearray(store.read(lambda t: t.get("rows", b"tq/1@a")))
    raw[-1] ^= 0x01
    store.write(lambda t: t.put("rows", b"tq/1@a", bytes(raw)))
    with pytest.raises(CorruptRecord, match="corrupt record 'rows/1@a': checksum mismatch"):
        client.get(["1@a"], custom_backend_meta=ids[1:])
    with pytest.raises(BadArgument, match="is of type object, which the kvckpt backend cannot store without pickling"):
        client.put(["5@a", "6@a"], [torch.ones(1), object()])
    assert client.count() == 2  # the refused batch wrote nothing, not even its first value
    client.close()


def test_storage_checkpoint_is_one_validated_file(tmp_path: Any) -> None:
    client = client_for(str(tmp_path / "live.kv"))
    ids = client.put(["0@x", "1@x"], [torch.arange(4), torch.arange(2)])
    os.mkdir(tmp_path / "ckpt")
    stamp = client.checkpoint(str(tmp_path / "ckpt"))
    assert (stamp["values"], stamp["file"]) == (2, ktq.CHECKPOINT_FILE)
    assert sorted(os.listdir(tmp_path / "ckpt")) == [ktq.CHECKPOINT_FILE]  # no .partial left behind
    client.clear(["0@x"], ids[:1])
    client.put(["2@x"], [torch.arange(9)])
    assert client.load(str(tmp_path / "ckpt"))["checkpoint_id"] == stamp["checkpoint_id"]
    assert client.count() == 2
    assert torch.equal(client.get(["0@x"], custom_backend_meta=ids[:1])[0], torch.arange(4))

    os.mkdir(tmp_path / "bad")
    with open(tmp_path / "ckpt" / ktq.CHECKPOINT_FILE, "rb") as src, \
            open(tmp_path / "bad" / ktq.CHECKPOINT_FILE, "wb") as dst:
        dst.write(src.read()[:5000])
    with pytest.raises(FormatError, match="truncated"):
        client.load(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError, match="no TransferQueue storage checkpoint"):
        client.load(str(tmp_path / "nowhere"))
    live = ktq.ValueStore(str(tmp_path / "live2.kv"))
    live.close()
    with pytest.raises(RecoveryError, match="not a checkpoint \\(no stamp\\)"):
        ktq.ValueStore(str(tmp_path / "other.kv")).load(str(tmp_path / "live2.kv"))
    assert client.count() == 2  # every refused load left the live store alone
    client.close()


def test_a_replay_buffer_file_is_not_a_value_store(tmp_path: Any, buffer_factory: Any) -> None:
    buf = buffer_factory(name="replay.kv")
    buf.close()
    with pytest.raises(FormatError, match="is a kvckpt replay buffer, not a TransferQueue value store"):
        ktq.ValueStore(buf.path)


def test_settings_are_checked() -> None:
    assert ktq.BackendSettings.from_config({"path": "/x.kv", "client_name": "ignored"}) == \
        ktq.BackendSettings("/x.kv", "actor", "KvckptValueStore", 0)
    with pytest.raises(BadArgument, match=r"needs backend\.kvckpt\.path"):
        ktq.BackendSettings.from_config({})
    with pytest.raises(BadArgument, match="owner must be one of \\('actor', 'process'\\), got 'thread'"):
        ktq.BackendSettings.from_config({"path": "/x.kv", "owner": "thread"})


# -- TransferQueue itself ---------------------------------------------------------------------------
#: One loopback-only Ray for the module (TransferQueue's controller is a Ray actor): ``ray_local``,
#: tests/conftest.py.
RAY_LOCAL = {"num_cpus": 2, "object_store_memory": 256 << 20, "namespace": "kvckpt-tq-test"}


def start_tq(path: str, owner: str = "actor") -> Any:
    return tq.init({"backend": {"storage_backend": "kvckpt", "kvckpt": {"path": path, "owner": owner}}})


def stop_tq() -> None:
    """Close TransferQueue and the owner actor, and wait until their names are free again."""
    tq.close()
    ktq.stop_value_store()
    deadline = time.monotonic() + 30
    for name in ("TransferQueueController", "KvckptValueStore"):
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace="transfer_queue")
            except ValueError:
                break
            time.sleep(0.1)


def batch(seeds: list[int]) -> TensorDict:
    """A TensorDict of samples ``seeds``: jagged token fields, dense fields, JSON values."""
    rows = [tensors(s) for s in seeds]
    return TensorDict({
        "input_ids": torch.nested.as_nested_tensor([r["input_ids"] for r in rows], layout=torch.jagged),
        "logprobs": torch.nested.as_nested_tensor([r["logprobs"] for r in rows], layout=torch.jagged),
        "reward": torch.stack([r["reward"] for r in rows]),
        "hidden": torch.stack([r["hidden"] for r in rows]),
        "text": [r["text"] for r in rows]}, batch_size=len(rows))


def sample_of(got: TensorDict, i: int) -> dict[str, Any]:
    """Sample ``i`` of a TensorDict TransferQueue returned, field by field."""
    return {name: column.unbind()[i] if isinstance(column, torch.Tensor) and column.is_nested else column[i]
            for name, column in ((n, got[n]) for n in sorted(got.keys()))}


def digest(sample: dict[str, Any]) -> str:
    """A digest of a sample's values: bytes, dtypes and shapes of tensors, JSON of the rest."""
    h = hashlib.sha256()
    for name in sorted(sample):
        value = sample[name]
        if isinstance(value, torch.Tensor):
            h.update(f"{name}{value.dtype}{tuple(value.shape)}".encode())
            h.update((value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().tobytes())
        else:
            h.update(json.dumps(value, sort_keys=True).encode())
    return h.hexdigest()


def check_batch(got: TensorDict, seeds: list[int]) -> None:
    """``got`` holds exactly samples ``seeds``, in order: equal bytes, dtypes and shapes."""
    assert [digest(sample_of(got, i)) for i in range(len(seeds))] == [digest(tensors(s)) for s in seeds]


def test_kv_api_through_transferqueue_and_a_recycled_global_index(ray_local: Any, tmp_path: Any) -> None:
    start_tq(str(tmp_path / "live.kv"))
    try:
        client = tq.get_client()
        assert type(client.storage_manager).__name__ == "KvckptStorageManager"
        other = OmegaConf.create({"backend": {"storage_backend": "kvckpt", "kvckpt": {"path": "other.kv"}}})
        with pytest.raises(BadArgument, match=r"'KvckptValueStore' already serves '.*/live\.kv'"):
            ktq.start_value_store(other)  # a second TransferQueue must not silently share the first's file
        meta = tq.kv_batch_put(keys=["k0", "k1", "k2"], partition_id=PARTITION, fields=batch([0, 1, 2]))
        assert sorted(meta.fields) == ["hidden", "input_ids", "logprobs", "reward", "text"]
        check_batch(tq.kv_batch_get(keys=["k0", "k1", "k2"], partition_id=PARTITION), [0, 1, 2])
        assert client.storage_manager.storage_client.count() == 15
        stale = client.kv_retrieve_meta(keys=["k1"], partition_id=PARTITION, create=False)

        tq.kv_clear(keys=["k1"], partition_id=PARTITION)
        assert client.storage_manager.storage_client.count() == 10
        assert sorted(tq.kv_list(PARTITION)[PARTITION]) == ["k0", "k2"]
        tq.kv_batch_put(keys=["k3"], partition_id=PARTITION, fields=batch([3]))
        fresh = client.kv_retrieve_meta(keys=["k3"], partition_id=PARTITION, create=False)
        assert fresh.global_indexes == stale.global_indexes  # TransferQueue reused k1's index for k3
        check_batch(tq.kv_batch_get(keys=["k3"], partition_id=PARTITION), [3])
        with pytest.raises(ktq.WriteIdentityMismatch, match=f"key '{stale.global_indexes[0]}@"):
            client.get_data(stale)  # k1's metadata must never be answered with k3's bytes
    finally:
        stop_tq()


def test_a_ray_worker_gets_the_backend_registered_without_importing_it(ray_local: Any, tmp_path: Any) -> None:
    start_tq(str(tmp_path / "live.kv"))
    try:
        # Defined here so Ray ships it by value: the worker imports neither this module nor kvckpt.
        @ray.remote(max_calls=1)
        def join_and_use(key: str) -> dict[str, Any]:
            import sys

            import torch
            import transfer_queue as tq

            before = [m for m in sys.modules if m.startswith("kvckpt")]
            tq.init()  # joins the running TransferQueue: no config, no import of the plugin
            tq.kv_put(key=key, partition_id="worker", fields={"x": torch.tensor([4, 5])})
            got = tq.kv_batch_get(keys=key, partition_id="worker")["x"]
            return {"before": before, "manager": type(tq.get_client().storage_manager).__name__,
                    "registered": "kvckpt.integrations.transferqueue" in sys.modules,
                    "got": [t.tolist() for t in got.unbind()]}

        # A fresh worker process (its own runtime env), so nothing imported by an earlier task helps.
        fresh = join_and_use.options(runtime_env={"env_vars": {"KVCKPT_TQ_FRESH_WORKER": str(tmp_path)}})
        seen = ray.get(fresh.remote("w0"), timeout=120)
        assert seen == {"before": [], "manager": "KvckptStorageManager", "registered": True, "got": [[4, 5]]}
        conf = ray.get(ray.get_actor("TransferQueueController", namespace="transfer_queue").get_config.remote())
        assert isinstance(conf.backend.kvckpt.plugin, ktq.PluginRef)  # what carries the registration
    finally:
        stop_tq()


def test_transferqueue_checkpoint_restores_in_a_fresh_process(ray_local: Any, tmp_path: Any) -> None:
    start_tq(str(tmp_path / "live.kv"))
    try:
        tq.kv_batch_put(keys=[f"k{s}" for s in range(4)], partition_id=PARTITION, fields=batch([0, 1, 2, 3]))
        tq.kv_clear(keys=["k1"], partition_id=PARTITION)
        tq.kv_batch_put(keys=["k4", "k5"], partition_id=PARTITION, fields=batch([4, 5]))
        tq.save_checkpoint(str(tmp_path / "ckpt"), metadata={"step": 7})
        tq.kv_batch_put(keys=["k6"], partition_id=PARTITION, fields=batch([6]))  # after the checkpoint
        saved_bytes = os.path.getsize(tmp_path / "ckpt" / ktq.CHECKPOINT_FILE)
    finally:
        stop_tq()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["controller_state.pkl", ktq.CHECKPOINT_FILE, "metadata.json"]
    proc = subprocess.run([sys.executable, __file__, ray_local, str(tmp_path / "restored.kv"), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    expected_keys = ["k0", "k2", "k3", "k4", "k5"]
    assert seen == {"keys": expected_keys, "digests": [digest(tensors(int(k[1:]))) for k in expected_keys],
                    "values": 25, "metadata": {"step": 7}}
    assert saved_bytes > 0


def _restore_child(address: str, path: str, checkpoint_dir: str) -> dict[str, Any]:
    """The fresh process: join the Ray cluster, start TransferQueue on an empty store, load."""
    kray.keep_ray_on_loopback()
    ray.init(address=address, namespace="kvckpt-tq-test")
    start_tq(path, owner="process")
    tq.load_checkpoint(checkpoint_dir)
    keys = sorted(tq.kv_list(PARTITION)[PARTITION])
    got = tq.kv_batch_get(keys=keys, partition_id=PARTITION)
    digests = [digest(sample_of(got, i)) for i in range(len(keys))]
    values = tq.get_client().storage_manager.storage_client.count()
    with open(os.path.join(checkpoint_dir, "metadata.json")) as f:
        metadata = json.load(f)["user_metadata"]
    tq.close()
    return {"keys": keys, "digests": digests, "values": values, "metadata": metadata}


if __name__ == "__main__":
    print(json.dumps(_restore_child(*sys.argv[1:4])))
