"""Every malformed input ends in one `Error:` line, exit code 1 and nothing written, within 10 s, from every command
that reads its kind: the corpus in tests/data/malformed/ (traces, plans, MiniMalloc CSVs, snapshot pickles,
HuggingFace configs; each
file's name says what is wrong with it), and inputs too big to keep there (a gzip bomb, /dev/zero, a nesting of
200,000 levels, 20,000 streams), made here. Most run in this process through click's runner, with an alarm for
the 10 s; a few run the real command line in a subprocess."""

from __future__ import annotations

import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from timeouts import within

import memplan
import memplan.planner.jobs.files  # noqa: F401  (the commands' modules, imported before the clock starts)
import memplan.planner.jobs.solve_file  # noqa: F401
import memplan.planner.replay.model_replay  # noqa: F401
from memplan.cli import main
from memplan.errors import MemplanError
from memplan.limits import MAX_INPUT_BYTES, MAX_PICKLE_BYTES
from memplan.planner.plan import load_plan
from memplan.traces.format import load
from memplan.traces.inputs.snapshot import import_snapshot
from memplan.units import human_bytes

CORPUS = Path(__file__).resolve().parent / "data" / "malformed"
MODEL = Path(__file__).resolve().parents[1] / "examples" / "bert.py"  # never run: its plan or trace fails first
SECONDS = 10


def readers(kind: str, path: str, out: Path) -> dict[str, list[str]]:
    """Every command that reads a file of this kind, on `path` (the other inputs valid), writing under `out`."""
    trace, plan = str(CORPUS / "good.trace.json"), str(CORPUS / "good.plan.json")
    if kind == "trace":
        return {
            "solve": ["solve", path, "-o", str(out / "p.json")],
            "simulate": ["simulate", path, "--timeline", str(out / "t.csv")],
            "plot": ["plot", path, "-o", str(out / "f.png")],
            "compare": ["compare", path],
            "export": ["export", path, "-o", str(out / "s.pickle")],
            "replay": ["replay", plan, str(MODEL), "--trace", path],
        }
    if kind == "plan":
        return {
            "simulate": ["simulate", trace, "--plan", path],
            "plot": ["plot", trace, "--plan", path, "--address-space", "-o", str(out / "f.png")],
            "compare": ["compare", trace, "--plan", path],
            "export": ["export", trace, "--plan", path, "-o", str(out / "s.pickle")],
            "replay": ["replay", path, str(MODEL), "--trace", trace],
        }
    if kind == "csv":
        return {"solve": ["solve", path, "-o", str(out / "p.csv")]}
    if kind == "config":  # a HuggingFace config.json: every command reads it through traces/inputs/hf_config.py
        return {
            "trace": ["trace", path, "--fake", "--seq", "8", "-o", str(out / "t.json")],
            "fit": ["fit", path, "--fake", "--memory", "16MiB", "--seq", "8", "--layers", "as-built"],
        }
    return {"import": ["import", path, "-o", str(out / "t.json.gz")], "explain": ["explain", path]}


def one_error_line(args: list[str], seconds: float = SECONDS) -> str:
    """Run one command in this process; assert exit code 1, no traceback, nothing on stdout and one `Error:` line
    that ends stderr, all within `seconds`; return that line."""
    with within(seconds):
        r = CliRunner().invoke(main, args)
    assert not isinstance(r.exception, TimeoutError), f"{args}: hung"
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, repr(r.exception), r.output[-2000:])
    assert r.stdout == "", (args, r.stdout[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and r.stderr.endswith(errors[0] + "\n"), (args, r.stderr[-2000:])
    assert len(errors[0]) < 400, (args, errors[0][:400])  # one readable line, not a dump of the input
    return errors[0]


# What each corpus file's error says (a fragment), so each is refused for its own fault.
EXPECTED = {
    "trace/bad_sync.json": "syncs[0]: expected [time, from_stream, to_stream]",
    "trace/bool_size.json": "buffers.size[0]: expected an integer, got True",
    "trace/column_lengths_differ.json": "buffers.free: has 2 entries but buffers.size has 4",
    "trace/cut_gzip.json.gz": "truncated or corrupt gzip data",
    "trace/empty.json": "not valid JSON at line 1 column 1",
    "trace/float_time.json": "buffers.alloc[0]: expected an integer, got 1.5",
    "trace/free_before_alloc.json": "free at 0 is before its allocation at 1",
    "trace/infinity_time.json": "Infinity is not a number JSON allows",
    "trace/many_streams.json": "300 distinct streams; memplan handles at most 256",
    "trace/meta_nested_40_deep.json": "meta: containers nested more than 32 deep",
    "trace/missing_column.json": "buffers.free: missing column",
    "trace/nan_in_meta.json": "NaN is not a number JSON allows",
    "trace/negative_size.json": "buffers.size[0]: negative value -1",
    "trace/negative_stream.json": "buffers.stream[1]: negative value -1",
    "trace/nested_100000_deep.json.gz": "JSON nested too deeply to read",
    "trace/nested_in_column.json": "buffers.size[0]: expected an integer, got [[[...]]]",
    "trace/not_gzip.json.gz": "cannot read (Not a gzipped file",
    "trace/not_json.json": "not valid JSON at line 1 column 1",
    "trace/not_utf8.json": "not valid JSON (not UTF-8 text)",
    "trace/number_of_5000_digits.json": "a number with more digits than Python reads",
    "trace/size_2e70.json": "buffers.size[0]: 1180591620717411303424 does not fit in 64 bits",
    "trace/sync_negative_stream.json": "syncs[0]: negative stream -1",
    "trace/string_size.json": "buffers.size[0]: expected an integer, got '1024'",
    "trace/sync_time_2e40.json": "syncs[0]: time 1099511627776 is beyond 1,048,584",
    "trace/times_2e40.json": "buffers.free[3]: time 1099511627776 is beyond 1,048,584",
    "trace/top_level_list.json": "expected a JSON object at the top level",
    "trace/truncated.json": "not valid JSON at line 1 column 61",
    "trace/unknown_category.json": "unknown category 'weights'",
    "trace/unknown_column.json": "buffers.colour: unknown column",
    "trace/wrong_format.json": "unknown format version 'memplan-trace/9'",
    "plan/alignment_2e63.plan.json": "field 'alignment' is 9223372036854775744, outside [1, 2**62)",
    "plan/alignment_zero.plan.json": "field 'alignment' is 0, outside [1, 2**62)",
    "plan/arena_2e70.plan.json": "field 'arena' is 1180591620717411303424, outside [0, 2**62)",
    "plan/arena_above_its_placement.plan.json": "the arena says 26624 bytes but the placement's highest buffer ends",
    "plan/bound_above_arena.plan.json": "lower bound of 13312 bytes is not between 0 and the arena of 6656 bytes",
    "plan/capacity_below_arena.plan.json": "arena of 6656 bytes exceeds the capacity of 1024 bytes",
    "plan/gap_nan.plan.json": "NaN is not a number JSON allows",
    "plan/gap_wrong.plan.json": "gap 0.5 is not arena / bound - 1 = 0",
    "plan/max_live_bound_raised.plan.json": "the bound says max-live, 6144 bytes, but the trace's max-live is 6656",
    "plan/misaligned_offset.plan.json": "offset 100 is not a multiple of the alignment 512",
    "plan/negative_offset.plan.json": "offsets must be non-negative integers below 2**62",
    "plan/nested_100000_deep.plan.json.gz": "JSON nested too deeply to read",
    "plan/not_json.plan.json": "not valid JSON at line 1 column 1",
    "plan/offset_2e63.plan.json": "offsets must be non-negative integers below 2**62",
    "plan/offset_beyond_arena.plan.json": "buffer 3 ends at byte 10752, beyond the arena of 6656 bytes",
    "plan/one_offset_short.plan.json": "plan has 3 offsets but the problem has 4 buffers",
    "plan/optimal_above_its_bound.plan.json": "status 'optimal' with arena 6656 and bound 6144 bytes: it is feasible",
    "plan/other_trace.plan.json": "trace digest differs",
    "plan/seconds_infinity.plan.json": "Infinity is not a number JSON allows",
    "plan/two_live_buffers_share_bytes.plan.json": "buffer 0 and buffer 1 may be live together but share bytes",
    "plan/unknown_status.plan.json": "status 'perfect' is not one of optimal, feasible",
    "plan/wrong_format.plan.json": "not a memplan-plan/1 file",
    "plan/wrong_types.plan.json": "field 'arena' has the wrong type (str)",
    "csv/bad_header.csv": "header lacks column 'id'",
    "csv/duplicate_ids.csv": "buffer ids are not unique",
    "csv/empty.csv": "empty file",
    "csv/fields_missing.csv": ":2: has 3 fields, the header has 4",
    "csv/float.csv": ":2: size '1e3' is not an integer",
    "csv/negative.csv": ":2: size -5 is negative",
    "csv/not_an_integer.csv": ":2: size 'big' is not an integer",
    "csv/not_utf8.csv": "cannot read (UnicodeDecodeError)",
    "csv/nul_byte.csv": ":2: size '5\\x00' is not an integer",
    "csv/number_of_5000_digits.csv": ":2: size '99999999999999999...999999999999999999' is not an integer",
    "csv/size_2e62.csv": ":2: size 4611686018427387904 is beyond 2**62",
    "csv/sizes_add_past_2e62.csv": "the buffers add up to about 4.61e+18 bytes",
    "csv/upper_below_lower.csv": ":2: upper 4 is below lower 5",
    "config/1e9_layers.json": "field 'num_hidden_layers' is 1000000000, outside [1, 1,024] (limits.CONFIG_RANGES)",
    "config/2e12_parameters.json": "the model has 2,224,862,593,024 parameters, more than --max-parameters",
    "config/architectures_a_string.json": "field 'architectures': expected a list of class names, got 'LlamaForC",
    "config/architectures_of_numbers.json": "field 'architectures': expected a list of class names, got [123]",
    "config/hidden_size_float.json": "field 'hidden_size': expected int, got float (value: 64.5)",
    "config/hidden_size_not_a_multiple_of_heads.json": "The hidden size (66) is not a multiple of the number of atte",
    "config/hidden_size_null.json": "field 'hidden_size': expected int, got NoneType (value: None)",
    "config/hidden_size_string.json": "field 'hidden_size': expected int, got str (value: '64')",
    "config/hidden_size_word.json": "field 'hidden_size': expected int, got str (value: 'two')",
    "config/layers_in_a_sub_config_negative.json": "field 'text_config.num_hidden_layers' is -1, outside [1, 1,024]",
    "config/misspelt_model_type.json": "model_type 'lama' is not one of the",
    "config/model_type_a_list.json": "model_type ['llama'] is not one of the",
    "config/nan_in_a_field.json": "NaN is not a number JSON allows",
    "config/negative_layers.json": "field 'num_hidden_layers' is -2, outside [1, 1,024] (limits.CONFIG_RANGES)",
    "config/nested_40_deep.json": "containers nested more than 32 deep",
    "config/no_attention_heads.json": "field 'num_attention_heads' is 0, outside [1, 65,536]",
    "config/not_json.json": "not a JSON config: not valid JSON at line 1 column 1",
    "config/number_of_5000_digits.json": "a number with more digits than Python reads",
    "config/top_level_list.json": "a HuggingFace config names its model_type; this one does not",
    "config/unknown_model_type.json": "model_type 'no-such-model' is not one of the",
    "config/vocabulary_2e70.json": "field 'vocab_size' is 1180591620717411303424, outside [1, 16,777,216]",
    "pickle/300_streams.pickle": "300_streams.pickle: buffers.stream: 300 distinct streams",
    "pickle/a_list.pickle": "expected a dict at the top level, got list",
    "pickle/alloc_at_live_address.pickle": "[0][1]: alloc at address 0x0, which is still live (allocated at entry 0)",
    "pickle/double_free.pickle": "[0][4]: free_requested of address 0x0, already freed at entry 3 and not allocated",
    "pickle/oom_without_device_free.pickle": "device_traces[0][1].device_free: expected an integer, got None",
    "pickle/unknown_action.pickle": "device_traces[0][1]: unknown action 'realloc'; PyTorch writes alloc,",
    "pickle/calls_os_system.pickle": "refused: the pickle asks for os.system",
    "pickle/empty.pickle": "not a readable pickle (EOFError",
    "pickle/entry_without_action.pickle": "device_traces[0][0]: expected an entry with an 'action'",
    "pickle/holds_a_set.pickle": "refused: the pickle holds a set",
    "pickle/holds_bytes.pickle": "refused: the pickle holds a bytes",
    "pickle/nested_100_deep.pickle": "refused: containers nested more than 32 deep",
    "pickle/no_device_traces.pickle": "snapshot.device_traces: missing or not a list",
    "pickle/persistent_id.pickle": "refused: the pickle holds a persistent reference",
    "pickle/self_reference.pickle": "refused: a container holds itself (a cycle)",
    "pickle/shared_2e25_paths.pickle": "device_traces[0][0].addr: expected an integer, got [[[...], [...]], [[...]",
    "pickle/size_2e70.pickle": "size_2e70.pickle: buffers.size[0]: 1180591620717411303424 does not fit in 64 bits",
    "pickle/string_address.pickle": "device_traces[0][0].addr: expected an integer, got '0x10'",
    "pickle/text.pickle": "not a readable pickle (UnpicklingError: invalid load key",
    "pickle/truncated.pickle": "not a readable pickle (UnpicklingError: pickle data was truncated)",
}
CORPUS_FILES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.glob("*/*"))


def test_every_corpus_file_has_its_expected_error():
    assert CORPUS_FILES == sorted(EXPECTED)


def warm(kind: str) -> None:
    """Import what a kind's readers load on first use, before the clock starts: for configs, transformers' Llama (a
    config's model is built on the meta device, so its class is imported)."""
    if kind == "config":
        import memplan.planner.jobs.fit  # noqa: F401
        import memplan.planner.jobs.trace  # noqa: F401
        from memplan.traces.inputs.hf_config import ConfigBuild

        ConfigBuild(CORPUS / "good.config.json")


@pytest.mark.parametrize("name", CORPUS_FILES)
def test_a_malformed_file_ends_in_one_line_from_every_command_that_reads_it(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a command would write by default lands here, and must not
    kind = name.split("/")[0]
    warm(kind)
    for command, args in readers(kind, str(CORPUS / name), tmp_path).items():
        line = one_error_line(args)
        assert EXPECTED[name] in line, (command, line)
    assert list(tmp_path.iterdir()) == []


def test_the_valid_corpus_files_pass_every_command(tmp_path):
    """The corpus's good files go through the same commands (the replay aside: it would run the model), so each
    refusal above is the malformed file's own."""
    for kind, name in (("trace", "good.trace.json"), ("plan", "good.plan.json"), ("csv", "good.csv"),
                       ("pickle", "good.pickle"), ("config", "good.config.json")):  # fmt: skip
        for command, args in readers(kind, str(CORPUS / name), tmp_path).items():
            if command != "replay":
                result = CliRunner().invoke(main, args)
                assert result.exit_code == 0, (args, result.output)


def test_a_plan_edited_to_overlap_live_buffers_is_refused_by_the_python_api_too(tmp_path):
    """Read from a file, or edited as a Plan object and handed to every view: a MemplanError each time."""
    trace = load(CORPUS / "good.trace.json")
    plan = load_plan(CORPUS / "good.plan.json", trace)
    for name in ("two_live_buffers_share_bytes", "arena_2e70", "bound_above_arena"):
        with pytest.raises(MemplanError):
            load_plan(CORPUS / "plan" / f"{name}.plan.json", trace)
    edited = [
        dataclasses.replace(plan, offsets=[plan.offsets[1], *plan.offsets[1:]]),  # buffers 0 and 1 share bytes
        dataclasses.replace(plan, arena=2**70, bound=2**70),
        dataclasses.replace(plan, bound=2 * plan.arena),
        dataclasses.replace(plan, gap=float("nan")),
    ]
    views = {
        "verify": lambda bad: memplan.verify(bad, trace),
        "simulate": lambda bad: memplan.simulate(trace, plan=bad),
        "compare": lambda bad: memplan.compare([trace], plans=[bad]),
        "plot": lambda bad: memplan.plot([trace], tmp_path / "f.png", plans=[bad]),
        "export_snapshot": lambda bad: memplan.export_snapshot(trace, tmp_path / "s.pickle", plan=bad),
    }
    for bad in edited:
        for view, call in views.items():
            with pytest.raises(MemplanError):
                call(bad)
                pytest.fail(f"{view} took {bad}")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    """Inputs too big to keep in the corpus, made small on disk: gzip bombs (past MAX_INPUT_BYTES decompressed, as
    gzip members of 16 MiB of zeros repeated), nestings of 200,000 levels, a trace of 20,000 streams, a HuggingFace
    config of 100,000 levels and one of 200 MB."""
    folder = tmp_path_factory.mktemp("big")
    member = gzip.compress(b"\0" * (16 << 20), mtime=0)
    bomb = member * (MAX_INPUT_BYTES // (16 << 20) + 1)
    files = {name: folder / name for name in ("bomb.json.gz", "bomb.plan.json.gz", "bomb.csv.gz")}
    for path in files.values():
        path.write_bytes(bomb)
    deep = 200_000
    files["deep.json"] = folder / "deep.json"
    files["deep.json"].write_text('{"format":"memplan-trace/1","meta":' + "[" * deep + "]" * deep + "}")
    files["deep.config.json"] = folder / "deep.config.json"
    files["deep.config.json"].write_text('{"model_type":"llama","x":' + "[" * 100_000 + "]" * 100_000 + "}")
    files["big.config.json"] = folder / "big.config.json"  # 200 MB, sparse: no disk taken
    with open(files["big.config.json"], "wb") as f:
        f.write(b'{"model_type": "llama", "padding": "')
        f.truncate(200 << 20)
    files["deep.pickle"] = folder / "deep.pickle"
    key = b"segments"
    files["deep.pickle"].write_bytes(
        b"\x80\x02}X" + len(key).to_bytes(4, "little") + key + b"]" * deep + b"a" * (deep - 1) + b"s."
    )
    n = 20_000
    columns = {
        "size": [512] * n,
        "alloc": list(range(1, n + 1)),
        "free": list(range(2, n + 2)),
        "stream": list(range(n)),
    }
    doc = {"format": "memplan-trace/1", "buffers": columns}
    files["streams.json"] = folder / "streams.json"
    files["streams.json"].write_text(json.dumps(doc))
    return files


GIB_READ = pytest.mark.slow  # reads a GiB (or half) before refusing it: about 2-4 s each on the project's machine
GIB_SECONDS = 60  # such a read's hang guard: a loaded machine took over 10 s (a hang would never end)
SLOW = pytest.mark.slow  # a fresh interpreter importing torch: 5-10 s; the fast lane keeps one


@pytest.mark.parametrize(
    "kind, command, name, expected",
    [
        pytest.param("trace", "simulate", "bomb.json.gz", "decompresses to more than", marks=GIB_READ),
        pytest.param("plan", "replay", "bomb.plan.json.gz", "decompresses to more than", marks=GIB_READ),
        pytest.param("csv", "solve", "bomb.csv.gz", "decompresses to more than", marks=GIB_READ),
        pytest.param("trace", "solve", "/dev/zero", "/dev/zero: holds more than", marks=GIB_READ),
        pytest.param("plan", "compare", "/dev/zero", "/dev/zero: holds more than", marks=GIB_READ),
        pytest.param("pickle", "import", "/dev/zero", "/dev/zero: holds more than", marks=GIB_READ),
        ("trace", "plot", "deep.json", "JSON nested too deeply to read"),
        ("config", "trace", "deep.config.json", "JSON nested too deeply to read"),
        ("config", "fit", "big.config.json", "holds more than 4.00 MiB, the most memplan reads"),
        ("pickle", "import", "deep.pickle", "refused: containers nested more than 32 deep"),
        ("trace", "simulate", "streams.json", "20,000 distinct streams; memplan handles at most 256"),
    ],
)
def test_inputs_past_the_limits_end_in_one_line(big, kind, command, name, expected, tmp_path, monkeypatch):
    """Each kind's readers all read through one function (files.read_bytes, then the kind's parser): one command
    per input shows the limit holds."""
    monkeypatch.chdir(tmp_path)
    warm(kind)
    path = name if name.startswith("/") else str(big[name])
    read_to_the_limit = name == "/dev/zero" or name.startswith("bomb")
    line = one_error_line(readers(kind, path, tmp_path)[command], GIB_SECONDS if read_to_the_limit else SECONDS)
    assert expected in line
    if read_to_the_limit:
        limit = MAX_PICKLE_BYTES if kind == "pickle" else MAX_INPUT_BYTES
        assert f"more than {human_bytes(limit)}, the most memplan reads" in line
    assert list(tmp_path.iterdir()) == []


def run_cli(args: list[str]) -> tuple[int, str]:
    """`memplan ARGS` in a fresh process: its imports first, then the command itself within SECONDS."""
    code = "import sys, memplan.cli, memplan.planner.jobs.files; print('ready', file=sys.stderr, flush=True); " \
           "sys.argv = ['memplan', *sys.argv[1:]]; memplan.cli.main()"  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stderr.readline() == "ready\n"
        proc.wait(timeout=SECONDS)  # the output is a few lines: no pipe fills while waiting
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"memplan {' '.join(args)}: still running after {SECONDS} s")
    assert proc.stdout.read() == ""
    return proc.returncode, proc.stderr.read()


@pytest.mark.parametrize(
    "kind, command, name, expected",
    [
        ("pickle", "import", "pickle/self_reference.pickle", "a container holds itself"),
        pytest.param("plan", "replay", "plan/two_live_buffers_share_bytes.plan.json", "share bytes", marks=SLOW),
        pytest.param("trace", "simulate", "trace/times_2e40.json", "is beyond 1,048,584", marks=SLOW),
    ],
)  # fmt: skip
def test_the_command_line_itself_ends_in_one_line(kind, command, name, expected, tmp_path):
    """The real entry point (exit code and stderr as a shell sees them) on inputs that hung or crashed it."""
    code, err = run_cli(readers(kind, str(CORPUS / name), tmp_path)[command])
    lines = err.splitlines()
    assert code == 1 and lines and lines[-1].startswith("Error:") and expected in lines[-1], err[-2000:]
    assert sum(line.startswith("Error:") for line in lines) == 1 and "Traceback" not in err


def test_the_python_api_raises_memplan_errors():
    """The same inputs through the API: a MemplanError subclass each, never a hang or another exception."""
    with within(SECONDS):
        for name in ("self_reference", "shared_2e25_paths", "nested_100_deep", "calls_os_system"):
            with pytest.raises(MemplanError):
                import_snapshot(CORPUS / "pickle" / f"{name}.pickle")
        for name in ("times_2e40.json", "nested_100000_deep.json.gz", "many_streams.json", "nan_in_meta.json"):
            with pytest.raises(MemplanError):
                load(CORPUS / "trace" / name)
