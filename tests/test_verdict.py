"""The verdict (planner/simulate/verdict.py): a bundled step that fits an H100 80GB by a margin is reported as
fitting with its headroom; one that does not runs out of memory at an op in a phase, the allocation the caching
allocator could not serve at the GPU's memory less the memory outside it; the outside terms follow the trace's
meta; `fit --gpu` gives `fit --memory`'s answer at the GPU's capacity; --memory and --gpu exclude each other."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from step_traces import step_trace

from memplan.cli import main
from memplan.gpus import CUBLASLT_WORKSPACE, NCCL_PER_PROCESS_GROUP, GPUError, gpu
from memplan.planner.jobs.fit import fit_model
from memplan.planner.jobs.optimize import OptimizeOptions
from memplan.planner.report.verdict_text import render_verdict
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import allocation_size, round_size, simulate_caching
from memplan.planner.simulate.measure import simulate_trace
from memplan.planner.simulate.verdict import device_memory, judge, judged, trace_budget
from memplan.step import StepSpec
from memplan.traces import make_trace, save
from memplan.traces.inputs.trace_model import trace_step
from memplan.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "examples" / "gpt2.py")
LLAMA = str(ROOT / "examples" / "llama.py")
BERT = str(ROOT / "examples" / "bert.py")
H100 = gpu("H100-80GB")
VERDICT_KEYS = {"gpu", "memory", "alloc_conf", "peak_live", "peak_allocated", "peak_reserved", "outside",
                "outside_bytes", "capacity", "total", "fits", "headroom", "oom", "program", "steps",
                "step_peak_allocated", "step_peak_reserved"}  # fmt: skip


def gpt2_step(batch: int):
    """One fake step of the bundled tiny GPT-2 at context 1024: nothing is allocated, so any batch traces."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEMPLAN_PRESET", "tiny")
        return trace_step(StepSpec(GPT2, batch=batch, seq=1024, fake=True))


@pytest.fixture(scope="module")
def fitting():
    return gpt2_step(256)  # about 26 GiB reserved


@pytest.fixture(scope="module")
def too_big():
    return gpt2_step(1024)  # about 103 GiB reserved


def test_a_step_that_fits_an_h100_is_reported_with_its_headroom(fitting):
    v = simulate_trace(fitting, "fits", gpu=H100).verdict
    unlimited = simulate_caching(fitting)
    assert v.fits and v.oom is None and v.gpu == "H100-80GB" and v.memory == H100.memory
    assert (v.peak_reserved, v.peak_allocated, v.peak_live) == (
        unlimited.peak_reserved, unlimited.peak_allocated, fitting.peak()[0])  # fmt: skip
    # a CPU-side trace holds no cuBLAS workspace: two handles' 32 MiB on Hopper, and cuBLASLt's for addmm
    assert [(t.name, t.bytes) for t in v.outside] == [
        ("CUDA context", H100.cuda_context), ("cuBLAS workspaces", 2 * 32 * MiB + CUBLASLT_WORKSPACE)]  # fmt: skip
    assert v.total == v.peak_reserved + v.outside_bytes and v.capacity == H100.memory - v.outside_bytes
    assert v.headroom == H100.memory - v.total > 40 * GiB  # fits by a margin
    text = render_verdict(v.to_dict())
    assert (
        text.startswith(
            "the whole program (2 training steps, construction included) fits H100-80GB (79.19 GiB): peak reserved "
        )
        and "+ CUDA context 512.0 MiB" in text
    )
    assert "headroom" in text and "\n" not in text


def test_a_step_that_does_not_fit_runs_out_at_an_op_in_a_phase(too_big):
    v = simulate_trace(too_big, "too big", gpu=H100).verdict
    assert not v.fits and v.headroom < 0
    o = v.oom
    assert v.program and v.steps == 2 and o.where == "step 1"  # the whole program was judged: the first step fails
    program = too_big.program.trace
    # the failed allocation is the program's buffer, named by its op, phase and module
    assert (program.op[o.buffer], program.phase[o.buffer], program.module[o.buffer]) == (o.op, o.phase, o.module)
    assert int(program.alloc[o.buffer]) == o.time and int(program.size[o.buffer]) == o.size
    assert o.op.startswith("aten::") and o.phase == "forward" and o.module.startswith("model.layers.")
    # it fails where the allocator, given the GPU less the outside terms, cannot add the segment it needs ...
    capacity = H100.memory - v.outside_bytes
    assert o.reserved + allocation_size(round_size(o.size, parse_alloc_conf(""))) > capacity
    # ... never before the unlimited allocator first reserves more than that
    unlimited = simulate_caching(program)
    assert o.time >= int(np.argmax(unlimited.reserved > capacity))
    assert v.total == unlimited.peak_reserved + v.outside_bytes > H100.memory
    text = render_verdict(v.to_dict())
    assert text.startswith(
        "the whole program (2 training steps, construction included) runs out of memory on H100-80GB (79.19 GiB) "
        f"at {o.op} in forward (module {o.module})"
    )
    assert "needs" in text and "more than the GPU has" in text
    assert simulate_trace(too_big, "too big", gpu=gpu("H200")).verdict.fits  # the same step fits an H200


def test_the_alloc_conf_is_the_one_simulated(too_big):
    conf = "expandable_segments:True"
    v = simulate_trace(too_big, "too big", alloc_conf=conf, gpu=H100).verdict
    expected = simulate_caching(judged(too_big), parse_alloc_conf(conf), capacity=H100.memory - v.outside_bytes).oom
    assert v.alloc_conf == conf and (v.oom.buffer, v.oom.size) == (expected.buffer, expected.size)
    assert f"with alloc-conf {conf} at" in render_verdict(v.to_dict())


@pytest.mark.parametrize("conf", ["", "garbage_collection_threshold:0.6", "max_split_size_mb:64"])
def test_the_unlimited_run_is_reused_only_where_it_is_the_same_run(fitting, too_big, conf):
    parsed = parse_alloc_conf(conf)
    small = dataclasses.replace(H100, memory=20 * GiB)  # the fitting step does not fit here
    for trace in (fitting, too_big):
        for g in (H100, small):
            budget = trace_budget(g, trace)
            reused = judge(trace, budget, parsed, conf, unlimited=simulate_caching(trace, parsed))
            assert reused == judge(trace, budget, parsed, conf)


def test_the_outside_terms_follow_the_trace_s_meta():
    a100 = gpu("A100-80GB")

    def terms(meta, g=H100):
        return {t.name: t.bytes for t in trace_budget(g, step_trace(meta=meta)).outside}

    assert terms({"device": "cpu"}) == {"CUDA context": H100.cuda_context, "cuBLAS workspaces": 2 * 32 * MiB}
    assert terms({"device": "cpu"}, a100)["cuBLAS workspaces"] == 2 * 8_519_680  # Ampere's default
    assert list(terms({"device": "cuda"})) == ["CUDA context"]  # a real CUDA trace holds them
    assert "cuBLAS workspaces" in terms({"device": "cuda", "fake": True})
    assert list(terms({"device": "cuda", "fake": True, "cublas_workspace": 32 * MiB})) == ["CUDA context"]
    assert terms({"device": "cpu", "world_size": 8, "rank": 0})["NCCL (1 process group)"] == NCCL_PER_PROCESS_GROUP
    assert terms({"world_size": 8, "process_groups": 3})["NCCL (3 process groups)"] == 3 * NCCL_PER_PROCESS_GROUP
    forward_only = make_trace(
        {"size": [1 << 20], "alloc": [1], "free": [2], "phase": ["forward"], "op": ["aten::addmm"]}, meta={}
    )
    workspaces = {t.name: t.bytes for t in trace_budget(H100, forward_only).outside}["cuBLAS workspaces"]
    assert workspaces == 32 * MiB + CUBLASLT_WORKSPACE  # one handle, and cuBLASLt for the addmm
    fake_cuda = dataclasses.replace(forward_only, meta={"device": "cuda", "fake": True, "cublas_workspace": 32 * MiB})
    lt_only = {t.name: t.bytes for t in trace_budget(H100, fake_cuda).outside}  # its capture took cuBLAS's
    assert lt_only == {"CUDA context": H100.cuda_context, "cuBLASLt workspace": CUBLASLT_WORKSPACE}


def test_a_fake_cuda_trace_holds_the_workspaces_and_the_verdict_adds_none(monkeypatch):
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    trace = trace_step(StepSpec(GPT2, batch=2, seq=64, device="cuda", fake=True))
    held = sorted(int(size) for size, c in zip(trace.size, trace.category) if c == "workspace")
    # the capture's own: two threads' cuBLAS handles, and the forward's cuBLASLt handle (GPT-2's Linear biases)
    assert held == [CUBLASLT_WORKSPACE] + [trace.meta["cublas_workspace"]] * 2
    assert trace.meta["cublaslt_workspace"] == CUBLASLT_WORKSPACE
    terms = {t.name: t.bytes for t in simulate_trace(trace, "fake cuda", gpu=H100).verdict.outside}
    assert terms == {"CUDA context": H100.cuda_context}


def test_a_fake_cuda_model_without_biases_takes_no_cublaslt_workspace(monkeypatch):
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    trace = trace_step(StepSpec(LLAMA, batch=2, seq=64, device="cuda", fake=True))
    held = [int(size) for size, c in zip(trace.size, trace.category) if c == "workspace"]
    assert held == [trace.meta["cublas_workspace"]] * 2  # Llama's Linears have no bias: no fused-bias addmm


def test_memplan_simulate_gpu(tmp_path, fitting, too_big):
    for name, trace in (("fits", fitting), ("too_big", too_big)):
        save(trace, tmp_path / f"{name}.json.gz")
    runner = CliRunner()
    fits = runner.invoke(main, ["simulate", str(tmp_path / "fits.json.gz"), "--gpu", "h100", "--json"])
    assert fits.exit_code == 0, fits.output
    verdict = json.loads(fits.stdout)["verdict"]
    assert set(verdict) == VERDICT_KEYS and verdict["fits"] and verdict["oom"] is None
    oom = runner.invoke(main, ["simulate", str(tmp_path / "too_big.json.gz"), "--gpu", "H100-80GB"])
    assert oom.exit_code == 0, oom.output
    assert "runs out of memory on H100-80GB (79.19 GiB) at aten::" in oom.stdout and " in forward " in oom.stdout
    plain = json.loads(runner.invoke(main, ["simulate", str(tmp_path / "fits.json.gz"), "--json"]).stdout)
    assert plain["verdict"] is None


def test_fit_and_optimize_take_memory_or_a_gpu_not_both():
    runner = CliRunner()
    for command in ("fit", "optimize"):
        for extra in ([], ["--memory", "1GiB", "--gpu", "L4"]):
            r = runner.invoke(main, [command, BERT, *extra])
            assert r.exit_code == 2 and "give --memory SIZE or --gpu NAME (exactly one)" in r.output
    step = StepSpec(BERT)
    with pytest.raises(GPUError, match="exactly one"):
        fit_model(step, 1 << 30, gpu=H100)  # before anything is traced
    with pytest.raises(GPUError, match="exactly one"):
        device_memory(None, None, step)
    opts = OptimizeOptions(step, gpu=H100)
    assert opts.memory == opts.budget.capacity == H100.memory - opts.budget.outside_bytes


@pytest.mark.slow  # two fits of four traces each: 15 s on a busy 2-core machine
def test_fit_gpu_gives_fit_memory_s_answer_at_the_gpu_s_capacity(monkeypatch):
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    step = StepSpec(BERT, seq=32)
    cuda = step.replace(device="cuda", fake=True)  # --gpu fits the GPU's CUDA steps (fake here: no GPU)
    memory, budget = device_memory(None, H100, cuda)
    small = dataclasses.replace(H100, name="H100 with 72 MiB to spare", memory=H100.memory - memory + (72 << 20))
    by_gpu = fit_model(step, gpu=small, modes=("baseline",), capture="fake", time_limit=0.5).summary()
    by_memory = fit_model(cuda, 72 << 20, modes=("baseline",), capture="fake", time_limit=0.5).summary()
    assert by_gpu["memory"] == by_memory["memory"] == 72 << 20
    assert by_gpu["gpu"]["gpu"]["name"] == small.name and by_memory["gpu"] is None
    assert by_gpu["modes"] == by_memory["modes"] and by_gpu["modes"][0]["caching"]["batch"] >= 1
