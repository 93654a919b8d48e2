"""The GPU catalogue (memplan/gpus.py): every name and alias finds its GPU in any case and spelling, no name finds
two, an unknown name is one line listing the known ones (exit code 1 from every command that takes --gpu), and
the figures follow the rules their comments cite (PyTorch's cuBLAS workspace rule, PCIe's arithmetic)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import memplan
from memplan.cli import main
from memplan.gpus import (
    CUBLAS_WORKSPACE_DEFAULT,
    CUBLAS_WORKSPACE_LARGE,
    GPUS,
    PCIE_GEN4_X16,
    PCIE_GEN5_X16,
    GPUError,
    gpu,
)
from memplan.units import GiB

BERT = str(Path(__file__).resolve().parents[1] / "examples" / "bert.py")


def test_every_name_and_alias_finds_its_gpu_in_any_spelling():
    names = [n for g in GPUS for n in (g.name, *g.aliases)]
    for g in GPUS:
        for name in (g.name, *g.aliases):
            for spelled in (name, name.lower(), name.upper(), name.replace("-", " "), name.replace("-", "_")):
                assert gpu(spelled) is g, spelled
    folded = {n.lower().replace(" ", "-").replace("_", "-") for n in names}
    assert len(folded) == len(names)  # no name (or alias) stands for two GPUs


def test_the_issue_s_names_are_in_the_catalogue():
    for name in ("H100", "H100-80GB", "h100-sxm", "NVIDIA H100 80GB HBM3"):
        assert gpu(name).name == "H100-80GB"
    wanted = {"H100-80GB", "H200", "A100-40GB", "A100-80GB", "L40S", "L4", "RTX-4090", "B200"}
    assert wanted <= {g.name for g in GPUS}
    assert gpu("4090") is gpu("NVIDIA GeForce RTX 4090") is gpu("rtx-4090")


def test_an_unknown_name_is_one_line_listing_the_known_ones():
    with pytest.raises(GPUError) as e:
        gpu("V100")
    message = str(e.value)
    assert "\n" not in message and message.startswith("--gpu V100: unknown GPU")
    assert all(g.name in message for g in GPUS)
    assert isinstance(e.value, memplan.MemplanError)


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "missing.trace.json.gz", "--gpu", "V100"],
        ["fit", BERT, "--gpu", "V100"],
        ["optimize", BERT, "--gpu", "V100"],
        ["run", BERT, "--gpu", "V100"],
    ],
)
def test_a_command_given_an_unknown_gpu_says_so_in_one_line(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: --gpu V100: unknown GPU (known: H100-80GB")
    assert "Traceback" not in result.output


def test_the_architecture_and_the_cublas_workspace_follow_pytorch_s_rule():
    by_arch = {g.name: g.architecture for g in GPUS}
    assert by_arch["A100-40GB"] == by_arch["A100-80GB"] == "Ampere"
    assert by_arch["L40S"] == by_arch["L4"] == by_arch["RTX-4090"] == "Ada"
    assert by_arch["H100-80GB"] == by_arch["H200"] == by_arch["GH200"] == "Hopper"
    assert by_arch["B200"] == "Blackwell"
    for g in GPUS:  # 32 MiB on Hopper and Blackwell, ":4096:2:16:8" before them: the two sizes measured
        big = g.architecture in ("Hopper", "Blackwell")
        assert g.cublas_workspace_bytes == (CUBLAS_WORKSPACE_LARGE if big else CUBLAS_WORKSPACE_DEFAULT)
    assert (CUBLAS_WORKSPACE_LARGE, CUBLAS_WORKSPACE_DEFAULT) == (33_554_432, 8_519_680)


def test_memory_and_host_link_figures():
    # totalGlobalMem: below the marketed size in GiB, above 90% of it (ECC and the driver take their share)
    marketed = {"H100-80GB": 80, "H100-PCIe-80GB": 80, "H200": 141, "GH200": 96, "A100-40GB": 40,
                "A100-80GB": 80, "L40S": 48, "L4": 24, "RTX-4090": 24, "B200": 180}  # fmt: skip
    for g in GPUS:
        assert 0.9 * marketed[g.name] * GiB < g.memory < marketed[g.name] * GiB, g.name
    assert gpu("GH200").memory == 95 * GiB  # the "95 GiB GPU" of the shared xl snapshots
    assert PCIE_GEN5_X16 == 2 * PCIE_GEN4_X16 + 1 and 31_500_000_000 < PCIE_GEN4_X16 < 31_510_000_000
    assert gpu("GH200").host_bandwidth > 7 * PCIE_GEN5_X16  # NVLink-C2C: 450 GB/s one way
    assert {g.host_link for g in GPUS} == {"PCIe gen4 x16", "PCIe gen5 x16", "NVLink-C2C"}


def test_the_catalogue_loads_no_torch():
    code = "import sys, memplan.gpus, memplan.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert done.stdout.strip() == "False"
