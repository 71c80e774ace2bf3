"""TransferQueue 0.1.11's own end-to-end suites, unchanged, against ``storage_backend: kvckpt``.

The suites ship inside TransferQueue's wheel (``site-packages/tests/e2e``). Each runs in a child
pytest that joins one loopback-only Ray cluster this module starts (``RAY_ADDRESS``; the suites'
own ``ray.init`` calls then connect to it instead of starting a cluster on the machine's address)
and loads this same file as a plugin (``-p test_tq_e2e``). As a plugin it points each suite's
backend table at kvckpt (a fresh store file and owner actor per suite), marks the tests that
assert SimpleStorage's own files as skipped with the reason, and writes every test's outcome to a
JSON file. The parent test then requires that every other collected test passed.

The child's driver imports :mod:`kvckpt.integrations.transferqueue` because its ``tq.init`` is
the one that names the backend; nothing else does. The Ray workers that call ``tq.init()`` inside
the suites import nothing themselves: the plugin must reach them on its own.

Skipped when TransferQueue (``pip install 'kvckpt[tq]'``) is not installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray
#: The suites' directory inside TransferQueue's wheel, and the suites run here.
SUITE_DIR = "tests/e2e"
SUITES = ("test_kv_interface_e2e.py", "test_e2e_lifecycle_consistency.py", "test_checkpoint_e2e.py")
#: Tests that assert SimpleStorage's own layout, not TransferQueue behaviour: ``suite::test`` -> why.
SIMPLE_STORAGE_ONLY = {
    "test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields":
        "asserts the checkpoint holds SimpleStorage's simple_storage/storage_unit_info.json "
        "(kvckpt writes one kvckpt_values.kv file instead)",
    "test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true":
        "asserts SimpleStorage's override (include_storage=False forced to True, simple_storage/ written); "
        "a KV backend keeps TransferQueue's documented meaning: controller state only",
    "test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch":
        "tampers with SimpleStorage's simple_storage/storage_unit_info.json, which kvckpt does not write",
}
#: Tests a suite skips itself (on every backend but one this machine lacks).
SUITE_SKIPS = {
    "test_e2e_lifecycle_consistency.py::test_gdr_gpu_tensor_roundtrip": "MooncakeStore_GDR with CUDA only",
    "test_e2e_lifecycle_consistency.py::test_gdr_cpu_tensor_roundtrip": "MooncakeStore_GDR with CUDA only",
}
BACKEND = "kvckpt"
RESULTS_ENV = "KVCKPT_TQ_E2E_RESULTS"
STORE_DIR_ENV = "KVCKPT_TQ_E2E_DIR"


def _suite_root() -> Path | None:
    """The directory holding TransferQueue's ``tests/e2e`` (its wheel installs them top-level)."""
    import importlib.util

    spec = importlib.util.find_spec("transfer_queue")
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent.parent
    return root if (root / SUITE_DIR).is_dir() else None


def _test_id(item: Any) -> str:
    return f"{Path(str(item.fspath)).name}::{item.nodeid.split('::', 1)[1]}"


# -- the child pytest: this file loaded as a plugin --------------------------------------------------
def _owner_of(suite: str, store_dir: str) -> tuple[str, str]:
    """The suite's store file and owner actor name."""
    name = suite.removesuffix(".py")
    return os.path.join(store_dir, f"{name}.kv"), f"KvckptValueStore-{name}"


def _backend_config(suite: str) -> dict[str, Any]:
    """The suite's config with kvckpt as the backend: its own store file and owner actor."""
    path, actor = _owner_of(suite, os.environ[STORE_DIR_ENV])
    return {"controller": {"polling_mode": True},
            "backend": {"storage_backend": BACKEND, BACKEND: {"path": path, "actor_name": actor}}}


def pytest_configure(config: Any) -> None:
    """Import the backend in the driver (the process whose ``tq.init`` names it)."""
    import kvckpt.integrations.transferqueue  # noqa: F401


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Point every suite at kvckpt and skip the SimpleStorage-only tests, naming why."""
    from omegaconf import OmegaConf

    for module in {item.module for item in items}:
        suite = Path(module.__file__).name
        conf = _backend_config(suite)
        if hasattr(module, "BACKEND_CONFIGS"):  # selected by TQ_TEST_BACKEND
            module.BACKEND_CONFIGS[BACKEND] = conf
        if hasattr(module, "_TQ_CONFIG"):  # the checkpoint suite has one fixed config
            module._TQ_CONFIG = OmegaConf.create(conf)
    for item in items:
        reason = SIMPLE_STORAGE_ONLY.get(_test_id(item))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"SimpleStorage layout: {reason}"))


def pytest_runtest_logreport(report: Any) -> None:
    """Record each test's outcome: the call's, or the setup's/teardown's if that failed or skipped."""
    if report.when == "call" or report.outcome != "passed":
        outcomes = _PLUGIN_STATE.setdefault("outcomes", {})
        key = f"{Path(report.fspath).name}::{report.nodeid.split('::', 1)[1]}"
        if outcomes.get(key, "passed") == "passed":
            outcomes[key] = report.outcome if report.when == "call" else f"{report.outcome} in {report.when}"
        if report.outcome == "failed":
            _PLUGIN_STATE.setdefault("errors", {})[key] = str(report.longrepr)[-3000:]


def pytest_collectreport(report: Any) -> None:
    """Record a suite that failed to import (it would otherwise just be missing)."""
    if report.outcome == "failed":
        _PLUGIN_STATE.setdefault("errors", {})[f"collect {report.nodeid}"] = str(report.longrepr)[-3000:]


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Hand the outcomes, failures and collected test ids to the parent."""
    with open(os.environ[RESULTS_ENV], "w") as f:
        json.dump({"outcomes": _PLUGIN_STATE.get("outcomes", {}), "errors": _PLUGIN_STATE.get("errors", {}),
                   "collected": [_test_id(i) for i in session.items]}, f, indent=1)


_PLUGIN_STATE: dict[str, Any] = {}


# -- the parent: one loopback Ray, one child pytest running every suite -----------------------------
@pytest.fixture(scope="module")
def suite_results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Run every suite once, in one child pytest on a loopback-only Ray with enough logical CPUs
    for TransferQueue's controller and the suites' worker tasks (logical: nothing is reserved)."""
    pytest.importorskip("transfer_queue")
    kray = pytest.importorskip("kvckpt.integrations.ray")
    import ray

    root = _suite_root()
    if root is None:
        pytest.skip("this TransferQueue wheel ships no tests/e2e")
    work = tmp_path_factory.mktemp("tq_e2e")
    results, stores = work / "results.json", work / "stores"
    stores.mkdir()
    (work / "pytest.ini").write_text("[pytest]\n")
    kray.init_local_ray(num_cpus=8, object_store_memory=256 << 20, namespace="kvckpt-tq-e2e")
    try:
        env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "TQ_TEST_BACKEND": BACKEND,
               RESULTS_ENV: str(results), STORE_DIR_ENV: str(stores),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "test_tq_e2e", "-p", "no:cacheprovider",
             "-c", str(work / "pytest.ini"), "--rootdir", str(root), *(str(root / SUITE_DIR / s) for s in SUITES)],
            env=env, cwd=work, capture_output=True, text=True, timeout=1200)
        assert results.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
        got = json.loads(results.read_text())
        yield got, stores
    finally:
        ray.shutdown()


@pytest.mark.parametrize("suite", SUITES)
def test_transferqueue_suite_passes_on_kvckpt(suite: str, suite_results: tuple[dict[str, Any], Path]) -> None:
    import kvckpt.integrations.transferqueue as ktq

    got, stores = suite_results
    mine = {k: v for k, v in got["outcomes"].items() if k.startswith(f"{suite}::")}
    errors = {k: v for k, v in got["errors"].items() if suite in k}
    assert errors == {}, "\n\n".join(f"{k}:\n{v}" for k, v in errors.items())
    assert set(mine) == {k for k in got["collected"] if k.startswith(f"{suite}::")} and mine
    skipped = {k for k, v in mine.items() if v.startswith("skipped")}
    assert skipped == {k for k in {**SIMPLE_STORAGE_ONLY, **SUITE_SKIPS} if k.startswith(f"{suite}::")}
    assert {k: v for k, v in mine.items() if k not in skipped and v != "passed"} == {}
    path, actor = _owner_of(suite, str(stores))
    assert os.path.isfile(path)  # the suite's values went through kvckpt: its value store file exists,
    _wait_for_release(ktq, path, actor)
    ktq.ValueStore(path).close()  # and is one (FormatError otherwise)


def _wait_for_release(ktq: Any, path: str, actor: str) -> None:
    """Stop the suite's owner actor if it still runs (``tq.close`` leaves it; the child's exit
    kills it asynchronously), then wait until its process let go of the store file: a blocking
    ``flock`` on the file returns exactly when the owner's writer lock is released, with no polling."""
    from ray.exceptions import RayActorError

    with contextlib.suppress(RayActorError):  # already dying with the child driver that owned it
        ktq.stop_value_store(actor)
    released = threading.Event()

    def lock_and_release() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
            released.set()
        finally:
            os.close(fd)

    waiter = threading.Thread(target=lock_and_release, daemon=True)
    waiter.start()
    waiter.join(timeout=300)  # a bound against a hang only: the lock is released when the actor's process exits
    assert released.is_set(), f"the owner actor {actor!r} still holds {path!r}"
