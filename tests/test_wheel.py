"""The built wheel, installed into a fresh virtual environment, is one `memplan` package whose commands
work from anywhere: the bundled default model and traces ship inside it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A new venv holding only memplan's wheel; torch and the other dependencies come from this
    environment's site-packages through a path file (so the test installs nothing from an index). The wheel is built
    with this environment's setuptools (not one installed afresh into an isolated build environment), and this
    environment's pip installs it into the new venv, which has no pip of its own (ensurepip takes longer than the
    rest of the setup)."""
    work = tmp_path_factory.mktemp("wheel")
    build = ["wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(work)]
    subprocess.run([sys.executable, "-m", "pip", *build, str(ROOT)], check=True, capture_output=True)
    (wheel,) = work.glob("memplan-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"memplan", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    env = work / "venv"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    install = ["--python", str(python), "install", "--no-deps", "--quiet", str(wheel)]
    subprocess.run([sys.executable, "-m", "pip", *install], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    # Only the path: this environment's own path files (memplan's editable install) are not run.
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return env


def run(env: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(env / "bin" / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True)


@pytest.mark.slow
def test_the_wheel_installs_one_package_and_its_commands_work(installed, tmp_path):
    (tmp_path / "cli.py").write_text("raise SystemExit('a user cli.py was imported')\n")  # a user's own modules
    (tmp_path / "traces.py").write_text("raise SystemExit('a user traces.py was imported')\n")
    where = run(installed, "python", "-c", "import memplan, memplan.api; print(memplan.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed)
    assert run(installed, "memplan", "run", "--help", cwd=tmp_path).returncode == 0
    out = tmp_path / "out"
    # One mode (each mode runs the same trace, solve and simulate): the bundled model's tempo step, its plan replayed.
    done = run(installed, "memplan", "run", "-o", str(out), "--batch", "1", "--seq", "16", "--time-limit", "1",
               "--replay-steps", "1", "--layers", "tempo", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "report.md").exists() and "bert_large_slice" in (out / "report.md").read_text()
    simulated = run(installed, "memplan", "simulate", next((out / "traces").glob("*tempo.trace.json.gz")).name,
                    cwd=out / "traces")  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
