"""FakeTensorMode's dispatch cache under a fake capture (traces/fake/dispatch_cache.py): a hit leaves every reference
count a miss leaves, so a trace is the same whether the cache, shared by the process, was empty or full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.step import StepSpec
from memplan.traces.fake.mode import FakeCapture
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.recorder import recording

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
COLUMNS = ("size", "alloc", "free", "stream", "internal", "category", "phase", "op", "module")


def test_a_cache_hit_leaves_the_reference_counts_of_a_miss():
    FakeTensorMode.cache.clear()
    hits = FakeTensorMode.cache_hits
    with recording(torch.device("cpu"), fake=True) as recorder, FakeCapture(recorder, "cpu"):
        x = torch.empty(7, 13)
        products = [x * 2 for _ in range(2)]  # a miss, then a hit
        views = [x.t() for _ in range(2)]
        counts = [recorder.references(t)[1] for t in (x, *products, *views)]
    assert FakeTensorMode.cache_hits == hits + 2
    # a product's storage is its own alone; x's is x's and its two views' (none held by a Python object of it)
    assert counts == [3, 1, 1, 3, 3]


def test_a_fake_trace_is_the_same_from_an_empty_cache_and_a_full_one():
    def trace():  # no warm-up step: it would fill the cache before the recorded step
        return trace_step(StepSpec(EXAMPLES / "bert.py", batch=2, seq=16, fake=True, warmup=False))

    FakeTensorMode.cache.clear()
    cold = trace()
    hits = FakeTensorMode.cache_hits
    warm = trace()
    assert FakeTensorMode.cache_hits > hits
    assert len(cold) == len(warm)
    for column in COLUMNS:
        assert np.array_equal(np.asarray(getattr(cold, column)), np.asarray(getattr(warm, column))), column
