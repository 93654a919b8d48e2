"""Ranks side by side (traces/ranks/family.py): `memplan run` and `fit --nproc` give each distinct rank's figures (a
1F1B pipeline's stages differ, FSDP2's ranks do not), fit names the tightest rank, `compare` and `plot` read a rank
family, and a family with a rank missing or world sizes that disagree is one `Error:` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memplan import api
from memplan.cli import main
from memplan.planner.jobs.fit import Point
from memplan.planner.report.fit_table import render_fit
from memplan.traces import make_trace, save
from memplan.traces.ranks.family import RankFamilyError, load_family, load_traces, rank_path

torch.set_num_threads(1)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def rank_trace(folder: Path, rank: int, world: int, ranks: list[int] | None = None, size: int = 1024) -> Path:
    """A one-buffer trace of `rank` of a world of `world` (standing for `ranks` too when given), at its rank file."""
    meta = {"rank": rank, "world_size": world, "backend": "fake"} | ({} if ranks is None else {"ranks": ranks})
    path = rank_path(folder / "t.json.gz", rank)
    save(make_trace({"size": [size], "alloc": [0], "free": [1]}, meta=meta), path)
    return path


def test_a_family_reads_each_distinct_trace_with_the_ranks_it_stands_for(tmp_path):
    """One file for rank 0, one standing for ranks 1-3 (no files for 2 and 3): two members, in rank order."""
    rank_trace(tmp_path, 1, 4, [1, 2, 3], size=2048)
    rank_trace(tmp_path, 0, 4)
    members = load_family(tmp_path / "t.json.gz")
    assert [(m.ranks, m.label, m.world_size) for m in members] == [((0,), "rank 0", 4), ((1, 2, 3), "ranks 1-3", 4)]
    assert [name for name, _ in load_traces([str(tmp_path / "t.json.gz")])] == [str(m.path) for m in members]


@pytest.mark.parametrize(
    "files, message",
    [
        ([(0, 4, None), (1, 4, [1, 2])], "t.rank3.json.gz: missing (rank 3 of 4; no rank trace stands for it)"),
        ([(0, 2, None), (1, 4, None)], "world sizes disagree (t.rank0.json.gz: 2, t.rank1.json.gz: 4)"),
        ([(0, 2, [0, 1]), (1, 2, None)], "rank 1 is stood for by both t.rank0.json.gz and t.rank1.json.gz"),
    ],
)
def test_a_broken_family_is_one_error_line_with_exit_code_1(tmp_path, files, message):
    """A rank no file stands for, world sizes that disagree, a rank twice: each command that reads the family says
    which in one line, exit code 1, and writes nothing."""
    for rank, world, ranks in files:
        rank_trace(tmp_path, rank, world, ranks)
    with pytest.raises(RankFamilyError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_family(tmp_path / "t.json.gz")
    for command in (["compare", "--method", "greedy"], ["plot", "-o", str(tmp_path / "p.png")]):
        result = CliRunner().invoke(main, [*command, str(tmp_path / "t.json.gz")])
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith("Error: ") and message in result.output
    assert not (tmp_path / "p.png").exists()


def test_rank_files_listed_by_hand_may_be_a_few_of_one_world_but_not_of_two(tmp_path):
    """Rank 0 and rank 3 of one world compare (one named twice too); rank files of one name from worlds of 2 and 4
    are refused."""
    listed = [str(rank_trace(tmp_path, 0, 4)), str(rank_trace(tmp_path, 3, 4))]
    assert [name for name, _ in load_traces(listed)] == listed
    assert len(load_traces([*listed, listed[0]])) == 3  # a file named twice is no rank stood for twice
    stale = str(rank_trace(tmp_path, 1, 2))
    result = CliRunner().invoke(main, ["compare", *listed, stale])
    assert result.exit_code == 1 and "world sizes disagree" in result.output


def test_the_job_fits_only_where_every_rank_fits_and_the_tightest_rank_is_the_highest():
    """fit's point over ranks: it fits where all fit, its figures the highest rank's; the tightest rank is it."""
    low = Point(1, 100, True, 90, 80, True, ranks=(0,))
    high = Point(1, 300, False, 250, 240, False, True, ranks=(1, 2, 3))
    job = Point.of_ranks(1, [low, high])
    assert (job.caching_peak_reserved, job.caching_fits, job.plan_arena, job.plan_fits) == (300, False, 250, False)
    assert job.plan_miss_proven and job.tightest("caching").ranks == job.tightest("plan").ranks == (1, 2, 3)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """`memplan run` of a 1F1B pipeline on 2 fake ranks: 8 layers, 4 micro-batches of 1 x 64 tokens."""
    out = tmp_path_factory.mktemp("pp") / "out"
    env = {"MEMPLAN_LAYERS": "8", "MEMPLAN_MICROBATCHES": "4", "MEMPLAN_PIPELINE_SCHEDULE": "1f1b"}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        args = ["run", str(EXAMPLES / "llama_pipeline.py"), "--nproc", "2", "--fake", "--batch", "4", "--seq", "64"]
        result = CliRunner().invoke(main, [*args, "--time-limit", "2", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_run_shows_a_pipelines_stages_side_by_side(pipeline_run):
    """One row per distinct rank: stage 0 keeps two micro-batches in flight, the last stage one, so stage 0 peaks
    higher; each row's trace and plan are its rank's files."""
    out, summary = pipeline_run
    assert summary["world_size"] == 2 and summary["ranks"] == [[0], [1]] and summary["replay"] is None
    first, last = summary["rows"]
    assert (first["ranks"], last["ranks"]) == ([0], [1])
    assert first["peak_live"] > last["peak_live"]
    assert first["trace_file"] == str(out / "traces" / "as-built.trace.rank0.json.gz")
    assert Path(first["trace_file"]).is_file() and Path(last["plan_file"]).is_file()
    report = (out / "report.md").read_text()
    assert "**as-built · rank 1**" in report and "on each of 2 ranks" in report


def test_compare_and_plot_read_the_run_as_a_rank_family(pipeline_run, tmp_path):
    """The run's traces/as-built.trace.json.gz stands for its rank files: compare gives a column per rank, with the
    run's peaks; plot a panel per rank."""
    out, summary = pipeline_run
    family = str(out / "traces" / "as-built.trace.json.gz")
    result = CliRunner().invoke(main, ["compare", family, "--method", "greedy", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["traces"]
    assert [r["peak_live"] for r in rows] == [r["peak_live"] for r in summary["rows"]]
    assert [r["title"].rsplit(" · ", 1)[1] for r in rows] == ["rank 0/2", "rank 1/2"]
    result = CliRunner().invoke(main, ["plot", family, "-o", str(tmp_path / "ranks.png"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["traces"] == [r["trace_file"] for r in summary["rows"]]
    assert (tmp_path / "ranks.png").stat().st_size > 0


def test_run_shows_fsdp2_ranks_equal(monkeypatch, tmp_path):
    """FSDP2 shards every parameter equally: under --fake its two ranks are alike by construction, traced once (and
    checked on rank 1), so run shows one row standing for both. An earlier run's rank files in the folder (rank 1
    traced alone, rank 3 of a world of 4) are removed, not read into the new family."""
    monkeypatch.setenv("MEMPLAN_LAYERS", "2")
    traces = tmp_path / "out" / "traces"
    stale = [rank_trace(traces, 1, 2), rank_trace(traces, 3, 4)]
    for path in stale:
        path.rename(rank_path(traces / "as-built.trace.json.gz", int(path.name.split(".rank")[1].split(".")[0])))
    result = api.run(EXAMPLES / "llama_fsdp2.py", tmp_path / "out", batch=2, seq=16, nproc=2, capture="fake",
                     modes=("as-built",), time_limit=2)  # fmt: skip
    assert [r.ranks for r in result.rows] == [[0, 1]] and result.rows[0].peak_live > 0
    family = load_family(traces / "as-built.trace.json.gz")
    assert [m.ranks for m in family] == [(0, 1)] and sorted(p.name for p in traces.iterdir()) == [
        "as-built.trace.rank0.json.gz"
    ]
    # --every-rank: each rank traced and shown, into the same folder (the one file for both replaced)
    args = ["run", str(EXAMPLES / "llama_fsdp2.py"), "-o", str(tmp_path / "out"), "--batch", "2", "--seq", "16",
            "--nproc", "2", "--fake", "--every-rank", "--layers", "as-built", "--time-limit", "2"]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["ranks"] for r in rows] == [[0], [1]] and rows[0]["peak_live"] == rows[1]["peak_live"]
    assert [m.ranks for m in load_family(traces / "as-built.trace.json.gz")] == [(0,), (1,)]


def test_fit_names_the_tightest_rank(monkeypatch):
    """GPipe on 2 fake ranks (the last stage holds the head's logits too), memory between the stages' plans at batch
    1: the lighter stage's plan fits, the tightest stage's does not, so no batch fits the job; the tightest rank is
    the one whose plan needs the most."""
    monkeypatch.setenv("MEMPLAN_LAYERS", "8")
    monkeypatch.setenv("MEMPLAN_PIPELINE_SCHEDULE", "gpipe")
    model = EXAMPLES / "llama_pipeline.py"
    probe = api.fit(model, 1024, layers=("as-built",), seq=64, capture="fake", nproc=2).summary()["modes"][0]
    needs = [r["at_next"] for r in probe["ranks"]["plan"]["per_rank"]]
    assert needs[1] > needs[0] and probe["ranks"]["plan"]["tightest"] == [1]
    memory = (needs[0] + needs[1]) // 2
    result = CliRunner().invoke(main, ["fit", str(model), "--memory", str(memory), "--layers", "as-built",
                                       "--seq", "64", "--nproc", "2", "--fake", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert "as-built: tightest rank 1 under the caching allocator, rank 1 under a plan" in render_fit(summary)
    mode = summary["modes"][0]
    assert mode["plan"]["batch"] == 0 and mode["ranks"]["plan"]["tightest"] == [1]
    assert [r["fits_at_next"] for r in mode["ranks"]["plan"]["per_rank"]] == [True, False]
