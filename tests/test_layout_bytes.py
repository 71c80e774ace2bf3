"""The bytes-per-commit benchmarks (issue 19, item 3) still run, and the layout replay stands for
the real buffer.

``benchmarks.layout_bytes`` is only worth reading if replaying the real buffer's writes under
today's layout writes what the buffer wrote; these tests hold that, on a small run, and that the
layouts it models write no more than today's. Bytes, not times: no timing is asserted.
"""

from __future__ import annotations

import os

import pytest

from benchmarks import commit_bytes, layout_bytes


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return layout_bytes.measure(24, "tiny", str(tmp_path_factory.mktemp("layouts")))


def test_the_replay_of_todays_layout_writes_what_the_buffer_wrote(measured: dict) -> None:
    assert measured["today"] == pytest.approx(measured["real"], rel=0.05)


def test_each_modelled_layout_writes_no_more_than_today(measured: dict) -> None:
    assert measured["bare"] < measured["one tree, no state write in a commit"] <= measured["one tree"] \
        <= measured["one prompt record"] < measured["today"]
    for name in layout_bytes.SHARES:  # on trees this small, some writes share a page with others
        assert measured[f"without {name}"] <= measured["today"], name
    assert measured["without everything but the rows"] < measured["today"]


def test_commit_bytes_measures_every_mode(tmp_path) -> None:
    r = commit_bytes.measure(8, "tiny", str(tmp_path))
    assert r["bare"] < r["kvckpt, no state write"] < r["kvckpt"]
    assert r["encoded_bytes_per_group"] > 0
    assert os.listdir(tmp_path) == []
