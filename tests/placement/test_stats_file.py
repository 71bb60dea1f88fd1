"""The routing-counts file: tokens and interval round-trip, older files still load, and a rewrite is atomic."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from vllm_expert_offload.placement import RoutingCounts, _atomic


def _counts(tokens: int | None = 12, interval: tuple[float, float] | None = (100.0, 400.5)) -> RoutingCounts:
    return RoutingCounts(np.arange(16).reshape(2, 8), (0, 1), None, tokens, interval)


def test_tokens_and_interval_round_trip(tmp_path) -> None:
    path = tmp_path / "stats.json"
    _counts().save(path)
    doc = json.loads(path.read_text())
    assert doc["tokens"] == 12 and doc["interval"] == {"start": 100.0, "end": 400.5}
    loaded = RoutingCounts.load(path)
    assert (loaded.tokens, loaded.interval) == (12, (100.0, 400.5))
    assert np.array_equal(loaded.counts, np.arange(16).reshape(2, 8))


def test_file_of_an_earlier_version_still_loads(tmp_path) -> None:
    path = tmp_path / "old.json"
    _counts().save(path)
    doc = json.loads(path.read_text())
    del doc["tokens"], doc["interval"]  # what version 1 wrote before this change
    path.write_text(json.dumps(doc))
    loaded = RoutingCounts.load(path)
    assert loaded.tokens is None and loaded.interval is None and loaded.counts.sum() == 120


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(tokens=-1), "tokens"),
        (lambda d: d.update(tokens=1.5), "tokens"),
        (lambda d: d.update(interval={"start": 5.0}), "interval"),
        (lambda d: d.update(interval={"start": 5.0, "end": 1.0}), "interval"),
    ],
)
def test_malformed_coverage_refused_with_file_named(tmp_path, edit, named: str) -> None:
    path = tmp_path / "bad.json"
    _counts().save(path)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"routing counts file {path}.*{named}"):
        RoutingCounts.load(path)


def test_merge_adds_tokens_and_spans_intervals() -> None:
    merged = RoutingCounts.merge([_counts(12, (100.0, 400.0)), _counts(30, (50.0, 200.0))])
    assert (merged.tokens, merged.interval) == (42, (50.0, 400.0))
    partial = RoutingCounts.merge([_counts(12), _counts(None, None)])
    assert partial.tokens is None and partial.interval is None and partial.counts.sum() == 240


def test_failed_rewrite_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch) -> None:
    path = tmp_path / "stats.json"
    _counts(tokens=1).save(path)
    before = path.read_text()

    def crash(*_args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_atomic.os, "replace", crash)
    with pytest.raises(OSError, match="No space left"):
        _counts(tokens=2).save(path)
    assert path.read_text() == before and os.listdir(tmp_path) == ["stats.json"]


def test_reader_never_sees_a_partial_file(tmp_path) -> None:
    """A writer rewrites a ~1 MB file while a reader parses it in a loop; a plain write_text fails this at once."""
    path = tmp_path / "big.json"
    _atomic.write_atomically(path, json.dumps({"n": 0, "pad": "x" * 1_000_000}))
    stop, seen, errors = threading.Event(), set(), []

    def read() -> None:
        while not stop.is_set():
            try:
                seen.add(json.loads(path.read_text())["n"])
            except ValueError as exc:
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for n in range(1, 40):
        _atomic.write_atomically(path, json.dumps({"n": n, "pad": "x" * 1_000_000}))
    stop.set()
    reader.join()
    assert not errors and len(seen) > 1
