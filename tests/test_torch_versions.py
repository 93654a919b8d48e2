"""The torch a step will run on (torch_versions.py, --torch): torch 2.11's attention kernel choices as torch 2.11
made them on an H200 (../shared/traces/h200-programs/sdpa_h200_torch211.json, 768 calls of `_fused_sdp_choice`),
its cuBLAS workspace, the measured memory outside the caching allocator, and the bytes given by hand (--outside).
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

import memplan
from memplan.cli import main
from memplan.gpus import CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_LARGE, GIVEN_SOURCE, GPUError, gpu
from memplan.planner.simulate.verdict import device_memory, outside_terms
from memplan.step import StepSpec
from memplan.torch_versions import INSTALLED, TORCH_2_11, TORCH_2_13, TorchVersionError, torch_rules
from memplan.traces.cuda.sdpa_choice import Operand, SdpaCall, SdpaFlags, priority_order, select_backend

H200 = gpu("H200")
MEASURED_H200_TORCH_211 = 804_061_184  # total_memory - free - reserved after three steps (PROGRAMS.md)


def json_call(row: dict, batch: int = 2) -> SdpaCall:
    """One row of the torch 2.11 file as a call: (batch, heads, seq, head dim) contiguous query, key and value; a
    boolean or float (seq, seq) mask, or is_causal; the file's dropout, grouped-query flag and grad mode."""
    dtype = getattr(torch, row["dtype"])
    q = Operand.dense((batch, row["hq"], row["seq"], row["head_dim"]), dtype, row["grad"])
    kv = Operand.dense((batch, row["hk"], row["seq"], row["head_dim"]), dtype, row["grad"])
    masks = {"bool": torch.bool, "float": dtype}
    mask = Operand.dense((row["seq"], row["seq"]), masks[row["mask"]]) if row["mask"] in masks else None
    return SdpaCall(q, kv, kv, mask, row["dropout"], row["mask"] == "causal", row["gqa"], row["grad"])


def test_torch_211s_rules_choose_what_torch_211_chose_on_an_h200_for_every_call(shared):
    recorded = json.loads((shared / "traces/h200-programs/sdpa_h200_torch211.json").read_text())
    assert recorded["torch"].startswith(TORCH_2_11.release.split("+")[0]) and recorded["cudnn"] == 91900
    capability = tuple(recorded["capability"])
    assert [int(b) for b in priority_order(capability, TORCH_2_11.cudnn_version, SdpaFlags())] == recorded["order"]
    rows = recorded["rows"]
    chosen = [int(select_backend(json_call(r), capability, flags=SdpaFlags(), rules=TORCH_2_11)) for r in rows]
    assert len(rows) == 768 and chosen == [r["choice"] for r in rows]
    # torch 2.13's rules part from it exactly where #174245 does: fp16/bf16 with dropout 0.1, no multiple of 1/16
    newer = [int(select_backend(json_call(r), capability, flags=SdpaFlags(), rules=TORCH_2_13)) for r in rows]
    differ = [r for r, a, b in zip(rows, chosen, newer) if a != b]
    assert len(differ) == 256 and all(r["dropout"] == 0.1 and r["dtype"] != "float32" for r in differ)
    assert {r["choice"] for r in differ} == {int(SDPBackend.CUDNN_ATTENTION)}


def test_torch_211_takes_a_batch_over_65535_to_cudnn_where_213_does_not():
    """#180718 (after 2.11) refuses cuDNN a batch or head count over 65,535: torch 2.13 runs flash there."""
    q = Operand.dense((70_000, 2, 64, 64), torch.bfloat16, True)
    call = SdpaCall(q, q, q, is_causal=True)
    assert select_backend(call, (9, 0), flags=SdpaFlags(), rules=TORCH_2_11) == SDPBackend.CUDNN_ATTENTION
    assert select_backend(call, (9, 0), flags=SdpaFlags(), rules=TORCH_2_13) == SDPBackend.FLASH_ATTENTION


def test_a_version_is_looked_up_by_its_major_and_minor():
    assert torch_rules("2.11.0+cu130") is TORCH_2_11 and torch_rules("v2.11") is TORCH_2_11
    assert (
        torch_rules(None) is INSTALLED and torch_rules("installed") is INSTALLED and torch_rules("2.13.0") is TORCH_2_13
    )
    assert INSTALLED.release.split(".")[:2] == torch.__version__.split(".")[:2]  # the installed torch's own rules
    for wrong in ("2.9", "3", "", "latest"):
        with pytest.raises(TorchVersionError, match="known: 2.13 \\(installed\\), 2.11"):
            torch_rules(wrong)


def test_an_unknown_torch_is_one_error_line(tmp_path):
    result = CliRunner().invoke(main, ["trace", "examples/llama.py", "--fake", "--device", "cuda", "--torch", "2.9"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and result.output.startswith("Error: --torch")


def test_the_cublas_workspace_follows_the_release(monkeypatch):
    """32 MiB on sm_90 in both; Blackwell's 32 MiB came after torch 2.11 (#175344)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    b200, h100 = gpu("B200"), gpu("H100")
    assert (b200.cublas_workspace(TORCH_2_13), b200.cublas_workspace(TORCH_2_11)) == (
        CUBLAS_WORKSPACE_LARGE,
        CUBLAS_WORKSPACE_DEFAULT,
    )
    assert h100.cublas_workspace(TORCH_2_11) == h100.cublas_workspace(TORCH_2_13) == CUBLAS_WORKSPACE_LARGE
    assert b200.cublas_workspace_bytes == b200.cublas_workspace(INSTALLED)


def attention_step(torch_version: str | None):
    """A bf16 attention layer's forward and backward with dropout 0.1, fake CUDA on an H200, recorded with the
    installed torch's rules or `torch_version`'s."""
    with memplan.record(fake=True, device="cuda", gpu="H200", torch=torch_version) as recording:
        qkv = torch.nn.Linear(64, 192, device="cuda", dtype=torch.bfloat16)
        opt = torch.optim.SGD(qkv.parameters(), lr=0.1)
        x = torch.randn(2, 256, 64, device="cuda", dtype=torch.bfloat16)
        with recording.step(qkv, opt):
            q, k, v = qkv(x).view(2, 256, 3, 4, 16).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).float().mean().backward()
            opt.step()
    return recording.trace


def test_a_fake_step_runs_the_kernel_of_the_torch_it_will_run_on():
    """Dropout 0.1 in bf16 on an H200: torch 2.11 runs cuDNN attention (its saved logsumexp (B, H, T, 1), seed and
    offset, and cuDNN's backward); torch 2.13 flash. The trace's meta names the rules it followed."""
    old, new = attention_step("2.11"), attention_step(None)
    assert (old.meta["torch_rules"], new.meta["torch_rules"]) == ("2.11", INSTALLED.version)
    assert {"aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_cudnn_attention_backward"} <= set(
        old.op
    )
    assert not any("flash" in op for op in old.op)
    assert "aten::_scaled_dot_product_flash_attention_backward" in set(new.op)
    assert old.meta["cublas_workspace"] == new.meta["cublas_workspace"] == CUBLAS_WORKSPACE_LARGE


def test_the_step_names_its_torch():
    step = StepSpec("examples/llama.py", device="cuda", fake=True, torch="2.11.0")
    assert step.torch is TORCH_2_11 and "--torch 2.11" in step.arguments()
    assert "--torch" not in StepSpec("examples/llama.py").arguments()


def fake_cuda_meta(version: str, **more) -> dict:
    """The meta of a fake CUDA trace that holds its cuBLAS and cuBLASLt workspaces, traced for torch `version`."""
    return {
        "device": "cuda",
        "fake": True,
        "cublas_workspace": 1,
        "cublaslt_workspace": 1,
        "torch_rules": version,
        **more,
    }


def test_the_outside_is_the_measurement_where_one_exists_and_the_estimate_elsewhere():
    """H200 with torch 2.11: the measured bytes (the workspaces live in the caching allocator, in the trace, so
    nothing is counted twice); torch 2.13 or another GPU: the estimate, said to be one."""
    (measured,) = outside_terms(H200, fake_cuda_meta("2.11"))
    assert (measured.name, measured.bytes) == ("CUDA context", MEASURED_H200_TORCH_211)
    assert measured.source.startswith("measured 2026-11-28") and "torch 2.11.0+cu130" in measured.source
    for g, version in ((H200, "2.13"), (gpu("H100"), "2.11")):
        (estimate,) = outside_terms(g, fake_cuda_meta(version))
        assert estimate.bytes == g.cuda_context and estimate.source.startswith("estimate:")
    # a real snapshot of a torch memplan has no rules for: the estimate, the workspaces held by the trace
    (old,) = outside_terms(H200, {"device": "cuda", "torch": "2.4.1+cu121"})
    assert old.source.startswith("estimate:")
    # a CPU trace judged for torch 2.11 on a B200 adds torch 2.11's workspace sizes, not 2.13's
    context, workspaces = outside_terms(gpu("B200"), {"device": "cpu", "torch_rules": "2.11"}, lt=False)
    assert (workspaces.name, workspaces.bytes) == ("cuBLAS workspaces", 2 * CUBLAS_WORKSPACE_DEFAULT)
    assert workspaces.source.startswith("torch 2.11's defaults") and context.source.startswith("estimate:")


def test_the_outside_given_by_hand_replaces_the_context_and_nccl():
    given = H200.given_outside(700 * 2**20)
    terms = outside_terms(given, fake_cuda_meta("2.11", world_size=8))
    assert [(t.name, t.bytes, t.source) for t in terms] == [
        ("outside the caching allocator", 700 * 2**20, GIVEN_SOURCE)
    ]
    assert H200.given_outside(None) is H200
    for wrong in (-1, H200.memory, 1.5, True):
        with pytest.raises(GPUError, match="--outside"):
            H200.given_outside(wrong)


def test_simulate_takes_the_outside_as_given(tmp_path):
    trace = attention_step("2.11")
    path = tmp_path / "attention.trace.json.gz"
    memplan.save_trace(trace, path)
    runner = CliRunner()
    measured = json.loads(runner.invoke(main, ["simulate", str(path), "--gpu", "H200", "--json"]).stdout)
    given = runner.invoke(main, ["simulate", str(path), "--gpu", "H200", "--outside", "1GiB", "--json"])
    outside = json.loads(given.stdout)["verdict"]["outside"]
    assert [(t["bytes"], t["source"]) for t in outside] == [(2**30, GIVEN_SOURCE)]
    assert [t["bytes"] for t in measured["verdict"]["outside"]] == [MEASURED_H200_TORCH_211]
    wrong = runner.invoke(main, ["simulate", str(path), "--outside", "1GiB"])
    assert wrong.exit_code == 2 and "--outside needs --gpu" in wrong.output


def test_fit_and_optimize_budget_for_the_torch_the_step_runs_on():
    """device_memory (fit's and optimize's budget) counts the measured outside for an H200 step on torch 2.11."""
    step = StepSpec("examples/llama.py", device="cuda", fake=True, gpu="H200")
    _, old = device_memory(None, H200, step.replace(torch="2.11"))
    _, new = device_memory(None, H200, step)
    assert [t.bytes for t in old.outside] == [MEASURED_H200_TORCH_211]
    assert [t.bytes for t in new.outside] == [H200.cuda_context]
