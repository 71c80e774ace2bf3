"""The benchmark command still runs end to end (``--quick``) and its results hold what they claim.

Runs ``python -m benchmarks.run --quick`` once in a fresh process (real stores, real crashes),
then checks the JSON, the report and the plots. No timing is asserted: only counts, sizes and
outcomes that are exact for the quick settings and seed 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import _paths
import pytest

ROOT = str(_paths.ROOT)
SAMPLERS = {"in_order", "weight_fifo", "windowed", "ready_first"}
SELECT_BATCH = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results.json"
    img = tmp / "img"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--work", str(tmp / "work"),
                           "--json", str(out), "--plots", str(img)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout, str(img)


def settings(run: tuple[dict[str, Any], str, str]) -> dict[str, Any]:
    return run[0]["settings"]


def test_ingest_commits_every_generated_group_to_every_store(run: tuple[dict[str, Any], str, str]) -> None:
    results, _, _ = run
    [size] = results["sizes"]
    ingest = size["ingest"]
    assert size["size_gb"] == settings(run)["sizes_gb"][0]
    assert ingest["groups"] > 0
    assert ingest["threads_groups"] == ingest["kvckpt_commit"]["n"] == ingest["bare_commit"]["n"] == ingest["groups"]
    assert ingest["raw_bytes"] >= size["size_gb"] * 1e9 > ingest["unpadded_bytes"]


def test_restore_builds_the_same_batch_shape_in_every_mode(run: tuple[dict[str, Any], str, str]) -> None:
    results, _, _ = run
    rows = settings(run)["groups_per_step"] * settings(run)["spec"]["group_size"]
    assert {mode: r["rows"] for mode, r in results["sizes"][0]["restore"].items()} == {
        "kvckpt": rows, "kvckpt_trusted": rows, "kvckpt_live": rows, "torch": rows, "torch_mmap": rows}


def test_checkpoints_ran_under_load_for_both_systems(run: tuple[dict[str, Any], str, str]) -> None:
    results, _, _ = run
    load = results["sizes"][0]["load"]
    for system in ("kvckpt", "baseline"):
        assert len(load[system]["ckpt"]["checkpoints"]) >= settings(run)["min_checkpoints"]
        assert load[system]["idle"]["checkpoints"] == load[system]["warmup"]["checkpoints"] == []
        assert load[system]["ckpt"]["commit"]["n"] > 0


def test_every_select_claims_a_full_batch(run: tuple[dict[str, Any], str, str]) -> None:
    results, _, _ = run
    latency = results["select"]["latency"]
    for samplers in latency.values():
        assert set(samplers) == SAMPLERS
        for by_count in samplers.values():
            assert sorted(by_count, key=int) == [str(c) for c in settings(run)["select_counts"]]
            for stats in by_count.values():
                assert stats["selected"] == [SELECT_BATCH] * settings(run)["select_repeats"]


def test_live_recovery_loses_nothing_and_checkpoint_only_loses_what_followed_the_checkpoint(
        run: tuple[dict[str, Any], str, str]) -> None:
    results, _, _ = run
    s = settings(run)
    interval = s["crash_steps_per_checkpoint"] * s["crash_groups_per_step"]
    crashes = results["crashes"]
    assert list(crashes) == s["crash_points"]
    for r in crashes.values():
        assert r["live"]["lost_groups"] == r["live"]["lost_tokens"] == 0
        assert r["checkpoint"]["lost_groups"] == r["acked_since_checkpoint"]
        assert r["live"]["selected"] == r["checkpoint"]["selected"] == s["crash_groups_per_step"]
    # one step of groups ahead, two checkpoint intervals, then half an interval
    mid = crashes["mid-interval"]
    assert (mid["acked"], mid["acked_since_checkpoint"], mid["checkpoint_file"]) == (
        s["crash_groups_per_step"] + 2 * interval + interval // 2, interval // 2,
        f"step-{2 * s['crash_steps_per_checkpoint']:04d}.kvckpt")
    assert crashes["during-copy"]["acked"] == s["crash_groups_per_step"] + 3 * interval


def test_report_and_plots_cover_every_figure(run: tuple[dict[str, Any], str, str]) -> None:
    _, report, img = run
    for n in range(1, 8):
        assert f"### Figure {n}:" in report
    assert "### Targets" in report
    pngs = sorted(os.listdir(img))
    assert pngs == ["fig1_commit_latency.png", "fig2_trainer_blocked.png", "fig3_restore.png", "fig4_ingest.png",
                    "fig5_bytes.png", "fig6_select.png", "fig7_work_lost.png"]
    for name in pngs:
        with open(os.path.join(img, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
