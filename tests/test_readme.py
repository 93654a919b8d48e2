"""The README is a short front door that runs as printed: under 12 KB, every `memplan` command in its code blocks
exits 0 (the quick start in a fresh folder, the main job in the slow lane), its Python example runs, and every
relative link in it, in CHANGELOG.md and in docs/ points to a file, and to a heading, that exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def code_blocks(text: str, language: str | None = None) -> list[str]:
    """The bodies of the fenced code blocks of `text` (only those marked `language`, when given)."""
    return [body for lang, body in FENCE.findall(text) if language is None or lang == language]


def memplan_commands(block: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, arguments) of each `memplan ...` command in a shell block, in order; `bash ...` lines and
    comments are not commands. `\\` joins lines and `&&` separates commands."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        if not re.search(r"(^|\s)memplan\s", line):
            continue  # output, a table, a bash line: nothing to split
        pieces: list[list[str]] = [[]]
        for word in shlex.split(line, comments=True):
            if word == "&&":
                pieces.append([])
            else:
                pieces[-1].append(word)
        for command in pieces:
            env = {}
            while command and ASSIGNMENT.match(command[0]):
                name, _, value = command.pop(0).partition("=")
                env[name] = value
            if command and command[0] == "memplan":
                commands.append((env, command[1:]))
    return commands


def command_blocks() -> list:
    """One test case per README code block holding memplan commands. A block that runs the main job is slow
    (88.5 s on an idle 2-core machine, 6.5 minutes on a busy one): tests/test_main_job.py runs `memplan run`
    on the tiny BERT at --seq 64, not the README's command, so the README's main job runs here, in the slow
    lane."""
    cases = []
    for block in code_blocks(README.read_text()):
        commands = memplan_commands(block)
        if commands:
            slow = any(args[:1] == ["run"] for _, args in commands)
            name = "+".join(args[0] for _, args in commands)  # trace+solve+simulate
            cases.append(pytest.param(commands, id=name, marks=[pytest.mark.slow] if slow else []))
    return cases


def test_the_readme_is_a_short_front_door():
    size = len(README.read_bytes())
    assert size < 12 * 1024, f"README.md is {size:,} bytes: move the depth into docs/"


def test_the_readme_shows_the_quick_start_and_the_main_job():
    shown = [args for case in command_blocks() for _, args in case.values[0]]
    assert {args[0] for args in shown} >= {"trace", "solve", "simulate", "run"}


@pytest.mark.parametrize("commands", command_blocks())
def test_the_readme_commands_run(commands, tmp_path, monkeypatch):
    """Each block's commands in turn, in a fresh folder that sees the repository's bundled model files."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    for env, args in commands:
        result = CliRunner().invoke(main, args, env=env)
        assert result.exit_code == 0, f"memplan {' '.join(args)}:\n{result.output[-3000:]}"
        if args[0] == "run":  # the main job prints the table the README shows
            check_main_job_table(result.stdout)


def check_main_job_table(printed: str) -> None:
    """The README's table of the main job, as it prints. The proof column (gaps) is left out: it is the
    solver's, the same on an idle or a busy machine but not on one twice as slow (docs/solvers.md)."""
    (shown,) = [b for b in code_blocks(README.read_text()) if b.startswith("layers ")]

    def rows(text: str) -> list[list[str]]:
        table = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
        return [cells[:5] + cells[6:] for cells in table if len(cells) == 7]

    assert rows(shown) and rows(printed)[: len(rows(shown))] == rows(shown)


def test_the_main_job_in_the_readme_is_what_scripts_run_sh_runs():
    """`bash scripts/run.sh` runs the README's main job, so the slow case above runs the same command."""
    (line,) = [ln for ln in (ROOT / "scripts" / "run.sh").read_text().splitlines() if ln.startswith("exec ")]
    script = shlex.split(line)[1:]
    assert script[0] == ".venv/bin/memplan" and script[-1] == "$@"
    shown = [args for case in command_blocks() for _, args in case.values[0] if args[0] == "run"]
    assert shown == [script[1:-1]]


def test_the_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    """The `memplan.record` example, run as printed (one torch thread: tests/conftest.py)."""
    (example,) = code_blocks(README.read_text(), "python")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {"__name__": "__main__"})
    assert re.search(r"peak live [\d,]+ B, plan arena [\d,]+ B \((optimal|feasible)\)", capsys.readouterr().out)
    assert (tmp_path / "mine.trace.json.gz").exists()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but hyphens, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    text = FENCE.sub("", page.read_text())
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        name, n = slug(heading), 1
        while name in found:  # GitHub numbers a repeated heading's anchor
            name, n = f"{slug(heading)}-{n}", n + 1
        found.add(name)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))  # links in code are not links
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, f"{page.name}:\n" + "\n".join(broken)
