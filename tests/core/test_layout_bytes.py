"""The bytes-per-commit benchmarks (issue 19, item 3) still run, and the layout replay stands for
the real buffer.

``benchmarks.layout_bytes`` is only worth reading if replaying the real buffer's writes under
format 3's layout writes what the buffer wrote; these tests hold that, on a small run, and that
format 3 writes less than format 2 and the variants it models no more than format 3. Bytes, not
times: no timing is asserted.
"""

from __future__ import annotations

import os

import pytest

from benchmarks import commit_bytes, layout_bytes


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return layout_bytes.measure(24, "tiny", str(tmp_path_factory.mktemp("layouts")))


def test_the_replay_of_format_3_writes_what_the_buffer_wrote(measured: dict) -> None:
    assert measured["format 3"] == pytest.approx(measured["real"], rel=0.05)


def test_format_3_writes_less_than_format_2_and_its_variants_no_more(measured: dict) -> None:
    assert measured["bare"] < measured["format 3"] < measured["format 2"]
    for name in ("format 3, one key per prompt", "format 3, no state write in a commit"):
        assert measured["bare"] < measured[name] <= measured["format 3"], name
    for name in layout_bytes.SHARES:  # on trees this small, some writes share a page with others
        assert measured[f"without {name}"] <= measured["format 2"], name
    assert measured["without everything but the rows"] < measured["format 2"]


def test_commit_bytes_measures_every_mode(tmp_path) -> None:
    r = commit_bytes.measure(8, "tiny", str(tmp_path))
    assert r["bare"] < r["kvckpt"]
    assert r["encoded_bytes_per_group"] > 0
    assert os.listdir(tmp_path) == []
