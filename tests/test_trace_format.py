"""The memplan-trace/1 format: round trips, live bytes, and one-line refusals of bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memplan.errors import TraceError
from memplan.traces import load, make_trace, save
from memplan.traces.format import to_dict


def small_trace():
    return make_trace(
        {
            "size": [100, 200, 50],
            "alloc": [0, 1, 3],
            "free": [2, 5, 4],
            "category": ["activation", "parameter", "temporary"],
            "phase": ["forward", "other", "backward"],
            "op": ["aten::mm", "", "aten::add"],
            "module": ["enc.0", "", "enc.1"],
            "stream": [0, 0, 7],
            "addr": [16, 4096, -1],
        },
        syncs=[(3, 0, 7)],
        meta={"model": "toy"},
    )


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_round_trip_keeps_every_field(tmp_path, name):
    t = small_trace()
    save(t, tmp_path / name)
    back = load(tmp_path / name)
    assert to_dict(back) == to_dict(t)


def test_live_bytes_and_peak():
    t = small_trace()
    assert list(t.live_bytes()) == [100, 300, 200, 250, 200]
    assert t.peak() == (300, 1)
    assert t.end == 5
    assert list(t.live_at(3)) == [1, 2]


def write(tmp_path, doc):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="memplan-trace/9"), "format: unknown format version"),
        (lambda d: d["buffers"]["free"].pop(), "buffers.free: has 2 entries but buffers.size has 3"),
        (lambda d: d["buffers"]["size"].__setitem__(1, -4), "buffers.size[1]: negative value -4"),
        (lambda d: d["buffers"]["alloc"].__setitem__(0, 1.5), "buffers.alloc[0]: expected an integer"),
        (lambda d: d["buffers"]["free"].__setitem__(2, 2), "buffers.free[2]: free at 2 is before its allocation at 3"),
        (
            lambda d: d["buffers"]["category"].__setitem__(0, "weights"),
            "buffers.category[0]: unknown category 'weights'",
        ),
        (lambda d: d["buffers"]["phase"].__setitem__(0, "warmup"), "buffers.phase[0]: unknown phase 'warmup'"),
        (lambda d: d.update(syncs=[[1, 2]]), "syncs[0]: expected [time, from_stream, to_stream]"),
        (lambda d: d["buffers"]["internal"].__setitem__(1, 2), "buffers.internal[1]: 2 is not 0 or 1"),
    ],
)
def test_validation_names_field_and_problem(tmp_path, mutate, message):
    doc = to_dict(small_trace())
    mutate(doc)
    with pytest.raises(TraceError) as e:
        load(write(tmp_path, doc))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_truncated_json_is_refused(tmp_path):
    p = tmp_path / "cut.json"
    p.write_text(json.dumps(to_dict(small_trace()))[:-20])
    with pytest.raises(TraceError, match="not valid JSON"):
        load(p)


def test_save_refuses_invalid_and_leaves_nothing(tmp_path):
    t = small_trace()
    t.free = np.array([2, 0, 4])
    with pytest.raises(TraceError):
        save(t, tmp_path / "out.json")
    assert list(tmp_path.iterdir()) == []


def test_bundled_traces_load_and_hold_every_category():
    """traces/data/ (scripts/bundle_traces.sh): real captured steps that load as they are, one per layer mode."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "traces" / "data"
    traces = {p.name: load(p) for p in sorted(folder.glob("*.trace.json.gz"))}
    assert len(traces) >= 6
    modes = {t.meta["layers"] for t in traces.values()}
    assert modes == {"baseline", "tempo", "selective", "tempo+selective"}
    for name, t in traces.items():
        assert t.meta["source"] == "memplan trace" and name.split(".")[-4] == t.meta["layers"], name
        assert {"parameter", "gradient", "optimizer", "activation", "temporary", "input"} <= set(t.category)
