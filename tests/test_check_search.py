"""`memplan check --largest NAME`: the largest value of the script's own option that fits, each value checked whole in
a process of its own (planner/jobs/check_search.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.planner.jobs.check_script import CheckError
from memplan.planner.jobs.check_search import varied

PLAIN = str(Path(__file__).resolve().parents[1] / "examples" / "scripts" / "plain_loop.py")
SMALL = ["--hidden", "256", "--layers", "2", "--vocab", "4096", "--seq", "128"]
ROOM = ["--gpu", "L4", "--outside", "21.8GiB"]  # about 190 MiB left to the caching allocator: a batch near 10


@pytest.mark.parametrize(
    "command,name,option,given,again",
    [
        (("python", "t.py", "--batch-size", "8", "--lr", "3"), "batch-size", "--batch-size", 8,
         ("python", "t.py", "--batch-size", "12", "--lr", "3")),
        (("t.py", "--batch_size=8"), "--batch-size", "--batch_size", 8, ("t.py", "--batch_size=12")),
        (("t.py", "--micro-batch", "2"), "micro_batch", "--micro-batch", 2, ("t.py", "--micro-batch", "12")),
    ],
)  # fmt: skip
def test_the_option_is_found_as_the_command_spells_it_and_varied_in_place(command, name, option, given, again):
    spelled, value, command_with = varied(command, name)
    assert (spelled, value, command_with(12)) == (option, given, again)


@pytest.mark.parametrize(
    "command,error",
    [
        (("t.py", "--lr", "3"), "gives no --batch-size VALUE to vary"),
        (("t.py", "--batch-size", "auto"), "gives --batch-size auto, not a whole number"),
        (("t.py", "--batch-size"), "gives --batch-size no value, not a whole number"),
        (("t.py", "--batch-size=0"), "gives --batch-size 0, not a whole number"),
    ],
)
def test_a_command_without_a_whole_number_to_vary_is_refused(command, error):
    with pytest.raises(CheckError) as raised:
        varied(command, "batch-size")
    assert str(raised.value) == f"--largest batch-size: the command {error}"


def test_the_command_line_refuses_it_in_one_line_before_anything_runs():
    result = CliRunner().invoke(main, ["check", "--largest", "batch-size", "--", "python", PLAIN, "--steps", "2"])
    assert result.exit_code == 1
    assert result.output.strip() == "Error: --largest batch-size: the command gives no --batch-size VALUE to vary"


def check(*args: str) -> dict:
    result = CliRunner().invoke(main, ["check", "--json", *args], catch_exceptions=False)
    assert result.exit_code in (0, 3), result.output
    return json.loads(result.stdout)


@pytest.mark.slow  # a process per value tried (about six) and two checks here: about a minute
def test_the_largest_fits_and_the_next_runs_out_as_checking_each_directly_says(tmp_path):
    """The search's answer agrees with `memplan check` run here, in this process, at the value it found and the one
    above: the first fits with the same peak reserved, the next runs out of memory."""
    page = tmp_path / "largest.html"
    found = check(*ROOM, "--largest", "batch-size", "--html", str(page), "--", "python", PLAIN, "--batch-size", "8",
                  *SMALL)  # fmt: skip
    largest = found["largest"]
    assert largest is not None and found["smallest_failing"] == largest + 1 and found["monotone"]
    tried = {t["value"]: t for t in found["trials"]}
    assert found["trials"][0]["value"] == 8 and tried[largest]["fits"] and not tried[largest + 1]["fits"]
    assert all(t["fits"] == (v <= largest) for v, t in tried.items())
    assert found["answer"]["command"][-len(SMALL) - 2 :] == ["--batch-size", str(largest), *SMALL]
    direct = check(*ROOM, "--", "python", PLAIN, "--batch-size", str(largest), *SMALL)
    assert direct["fits"] and direct["peak_reserved"] == found["answer"]["peak_reserved"]
    above = check(*ROOM, "--", "python", PLAIN, "--batch-size", str(largest + 1), *SMALL)
    assert not above["fits"] and tried[largest + 1]["failure"].endswith(above["failures"][-1]["where"])
    title = re.search(r"<h1>memplan check: (.*) on a fake L4</h1>", page.read_text())[1]
    assert f" --batch-size {largest} " in title  # the page is the largest's program
