"""Where a program branches on a value nobody knows (traces/fake/branches.py): a read that decides a conditional jump
in the program's own code is named; one stored, printed, formatted or passed on is not."""

from __future__ import annotations

import pytest

from memplan.traces.fake.branches import branch_site

# A fake tensor's scalar reads as torch's code makes them: frames of a library module, which branch_site looks past.
LIBRARY = {"__name__": "torch.fake_reads", "branch_site": branch_site, "sites": []}
exec(
    "class Tensor:\n"
    "    def _read(self):\n        sites.append(branch_site())\n        return 0.0\n"
    "    def item(self):\n        return self._read()\n"
    "    def __float__(self):\n        return self._read()\n"
    "    def __bool__(self):\n        return bool(self._read())\n",
    LIBRARY,
)


def _site(program: str) -> str | None:
    LIBRARY["sites"].clear()
    scope = {"loss": LIBRARY["Tensor"](), "flag": True, "print": lambda *a: None}
    exec(compile(program, "train.py", "exec"), scope)
    (site,) = LIBRARY["sites"]
    return site


@pytest.mark.parametrize(
    "program",
    ["if loss.item() > 1e4:\n    pass", "while loss.item() > 2:\n    pass", "x = 1 if loss.item() else 2",
     "assert loss.item() < 3", "if float(loss) > 0:\n    pass", "if loss:\n    pass", "assert not loss"],
)  # fmt: skip
def test_a_read_that_decides_a_jump_is_a_branch_at_its_line(program):
    assert _site(program) == "train.py:1"


@pytest.mark.parametrize(
    "program",
    ["x = loss.item()", "print(loss.item())", "losses = [loss.item()]",
     "s = f\"{loss.item():.4f} {'a' if flag else 'b'}\"",
     "print(f\"loss {loss.item():.4f}, mem {2 if flag else 0:.2f}\")", "loss.item()", "x = float(loss)"],
)  # fmt: skip
def test_a_read_stored_printed_or_formatted_is_not_a_branch(program):
    assert _site(program) is None
