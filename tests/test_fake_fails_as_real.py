"""A fake step fails where the real step fails, in one line: indices known out of range raise what the real op
raises (traces/fake/known_values.py, check_bounds), and torch's fake-tensor logger keeps its traceback to itself unless
asked (traces/fake/quiet_logs.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from memplan.cli import main
from memplan.traces.capture import recording_session
from memplan.traces.fake.quiet_logs import VERBOSE, _without_tracebacks

# GPT-2 whose position table is shorter than the sequence traced: its position ids come from `arange`.
GPT2_SHORT = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 8, "vocab_size": 64,
              "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
MIXTRAL = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64,
           "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip


def _config(tmp_path, fields: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


@pytest.mark.parametrize("fake", [True, False], ids=["fake", "real"])
def test_a_sequence_past_gpt2s_positions_fails_fake_as_real_in_one_line(tmp_path, monkeypatch, fake):
    """`--seq 64` on a GPT-2 config with `n_positions` 8: the real step's embedding raises IndexError, and so does
    the fake one now (it gave a trace), one `Error:` line, exit code 1, nothing written."""
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path, GPT2_SHORT)
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(main, ["trace", str(config), *(["--fake"] if fake else []), "--seq", "64", "-o", out])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and result.stderr.endswith(errors[0] + "\n"), result.stderr[-2000:]
    assert "raised IndexError: index out of range in self" in errors[0]
    assert not out.exists()


CALLS = {
    "embedding": lambda t, i: nn.functional.embedding(i, t),
    "index_select": lambda t, i: t.index_select(0, i),
    "gather": lambda t, i: t.gather(0, i.unsqueeze(1).expand(-1, 3)),
    "index": lambda t, i: t[i],
    "index dim 1": lambda t, i: t[:, i],
}
INDICES = {"in range": (0, 3), "past the end": (0, 9), "negative": (-3, 0), "far negative": (-9, 0)}  # arange's


def _outcome(call, table, indices):
    """The kind of error `call(table, indices)` raises, or None."""
    try:
        call(table, indices)
    except (IndexError, RuntimeError) as e:
        return type(e)
    return None


@pytest.mark.parametrize("op", list(CALLS))
def test_known_indices_out_of_range_raise_what_the_real_op_raises(op):
    """Each checked op on indices from `arange` (known to a fake step) against the real op on the same values: the
    same kind of error, or none; indices nobody knows (randint's) are left to run."""
    call = CALLS[op]
    real = {case: _outcome(call, torch.zeros(8, 3), torch.arange(*ends)) for case, ends in INDICES.items()}
    with recording_session(fake=True):
        fake = {case: _outcome(call, torch.zeros(8, 3), torch.arange(*ends)) for case, ends in INDICES.items()}
        assert _outcome(call, torch.zeros(8, 3), torch.randint(0, 3, (5,))) is None
    assert fake == real
    assert real["past the end"] is (RuntimeError if op == "gather" else IndexError)


@pytest.mark.parametrize(
    "fields",
    [{"num_local_experts": 0}, {"num_local_experts": 2, "num_experts_per_tok": 4}],
    ids=["0 experts", "top-4 of 2"],
)
def test_a_router_the_meta_kernel_refuses_is_one_line_on_the_terminal(tmp_path, fields):
    """torch's fake tensor mode logged a 16-line traceback before memplan's own line: the real command line's stderr
    is memplan's progress line and its one `Error:` line (a fresh process: torch's handler writes to the real
    stderr)."""
    config = _config(tmp_path, {**MIXTRAL, **fields})
    command = [sys.executable, "-m", "memplan.cli", "trace", str(config), "--fake", "--seq", "16", "-o", "t.json"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and done.stdout == "", done.stderr[-3000:]
    assert len(lines) == 2 and lines[0].startswith("building") and lines[1].startswith("Error:"), done.stderr[-3000:]
    assert "RuntimeError: k not in range for dimension" in lines[1]
    assert not (tmp_path / "t.json").exists()


def test_third_party_tracebacks_are_dropped_unless_asked(monkeypatch):
    """The filter drops a torch logger's record that carries a traceback, keeps its warnings and the program's own
    tracebacks; MEMPLAN_VERBOSE (`memplan -v`) keeps everything."""
    from memplan.traces.fake import quiet_logs

    seen = []
    handle = _without_tracebacks(lambda logger, record: seen.append(record.name))
    try:
        raise RuntimeError("k not in range for dimension")
    except RuntimeError:
        exc_info = sys.exc_info()
    for name, info in [("torch._subclasses.fake_tensor", exc_info), ("torch._subclasses.fake_tensor", None),
                       ("train", exc_info), ("torchvision_like_but_not_torch", exc_info)]:  # fmt: skip
        handle(logging.getLogger(name), logging.LogRecord(name, logging.ERROR, __file__, 1, "m", (), info))
    assert seen == ["torch._subclasses.fake_tensor", "train", "torchvision_like_but_not_torch"]
    assert list(quiet_logs.patches())
    monkeypatch.setenv(VERBOSE, "1")
    assert not list(quiet_logs.patches())
    result = CliRunner().invoke(main, ["-v", "--help"])
    assert result.exit_code == 0 and "--verbose" in result.output
