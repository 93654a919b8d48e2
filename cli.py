"""The `memplan` command line: argument parsing, progress and exit codes; the logic lives in the packages."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import threading

import click

from memplan.errors import MemplanError
from memplan.gpus import GPU, GPUS, gpu
from memplan.modes import LOSSES, OPTIMIZERS, PER_LAYER_MODES, losses_help, modes_help, optimizers_help
from memplan.planner.simulate.alloc_conf import TIE_BREAKS
from memplan.step import DTYPES, StepSpec, require_fake_for_routing
from memplan.torch_versions import INSTALLED, RELEASES
from memplan.units import SizeError, human_bytes, parse_bandwidth, parse_size


class MemplanGroup(click.Group):
    """A click group that turns memplan's typed errors into one line and exit code 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MemplanError as e:
            raise click.ClickException(str(e)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, but a usage error is one line too (click prints the usage block before it)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            with sigterm_raises():
                code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Terminated:
            click.echo("Error: terminated by SIGTERM (temporary files removed; finished outputs kept)", err=True)
            sys.exit(128 + signal.SIGTERM)
        except click.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"Error: {e.format_message()}{hint}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


class Terminated(BaseException):
    """SIGTERM arrived. Raised where the command is, like Ctrl-C's KeyboardInterrupt (and, like it, past `except
    Exception`), so every `finally` and every atomic write's cleanup runs before the process exits."""


def _raise_terminated(_signum, _frame):
    raise Terminated


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Terminated inside the block instead of killing the process where it stands (which left a
    half-written temporary file behind); the previous handler comes back after it. Only the main thread can set a
    handler: elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Size(click.ParamType):
    """A memory size option: 11GiB, 16GB, 512MiB, 1.5 GiB or a number of bytes (units.parse_size)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        try:
            return value if isinstance(value, int) else parse_size(value)
        except SizeError as e:
            self.fail(str(e), param, ctx)


SIZE = Size()


class ParameterCount(click.ParamType):
    """A count of parameters: digits (underscores allowed) or a whole number in e notation (2e12)."""

    name = "count"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().replace("_", "")
        try:
            count = int(text) if text.isdigit() else int(float(text)) if float(text).is_integer() else None
        except (ValueError, OverflowError):
            count = None
        if count is None or count < 1:
            self.fail(f"{value!r}: a whole number of parameters, at least 1 (2e12 or 2000000000000)", param, ctx)
        return count


PARAMETER_COUNT = ParameterCount()
LAYERS_HELP = f"Layer mode (memplan.modes). {modes_help()} The trace says what was swapped and what was left as built."
LOSS_HELP = f"The step's loss (memplan.modes). {losses_help()} The trace says what it changed, or why nothing."
OPTIMIZER_HELP = (
    f"The step's optimizer (memplan.modes), the model file's AdamW or Adam rebuilt with its groups and "
    f"hyperparameters; any other is refused. {optimizers_help()} The trace states its state's bytes."
)


# A model file (.py), a HuggingFace config.json, or a folder holding one (docs/capture.md).
MODEL_FILE = click.Path()
STEP_DEFAULTS = {field.name: field.default for field in dataclasses.fields(StepSpec)}  # the one set of defaults


def shape_option(name: str, what: str):
    """A whole-number option of the step's shape that build() takes (--batch, --seq), StepSpec's default."""
    default, help_text = STEP_DEFAULTS[name.removeprefix("--")], f"{what} passed to build()."
    return click.option(name, type=click.IntRange(min=1), default=default, show_default=True, help=help_text)


def step_options(*, batch: bool = False, layers: bool = False, loss: bool = False, routing: bool = True):
    """The options that shape a model file's step, declared once for every command that builds one: --seq, --dtype
    and --optimizer, and --batch, --layers, --loss and --routing (fake steps) where the command takes them; choices
    and defaults are StepSpec's."""
    options = [shape_option("--batch", "Batch size")] if batch else []
    options += [shape_option("--seq", "Sequence length")]
    options += [click.option("--dtype", type=click.Choice(DTYPES), default=STEP_DEFAULTS["dtype"], show_default=True)]
    layers_option = click.option("--layers", default=STEP_DEFAULTS["mode"], show_default=True, help=LAYERS_HELP)
    options += [layers_option] if layers else []
    loss_option = click.option(
        "--loss", type=click.Choice(tuple(LOSSES)), default=STEP_DEFAULTS["loss"], show_default=True, help=LOSS_HELP
    )
    options += [loss_option] if loss else []
    options += [
        click.option(
            "--optimizer",
            type=click.Choice(tuple(OPTIMIZERS)),
            default=STEP_DEFAULTS["optimizer"],
            show_default=True,
            help=OPTIMIZER_HELP,
        )
    ]
    options += [
        click.option(
            "--max-parameters",
            type=PARAMETER_COUNT,
            default=STEP_DEFAULTS["max_parameters"],
            show_default=True,
            metavar="N",
            help="The most parameters a HuggingFace config's model may have (2e12, or digits), counted on the meta "
            "device before anything is built: a config past it is refused (docs/limits.md). Python model files: not "
            "checked.",
        )
    ]
    routing_option = click.option(
        "--routing",
        default=STEP_DEFAULTS["routing"],
        show_default=True,
        metavar="RULE",
        help="How a fake step's mixture of experts routes its tokens (fake router scores have no values): "
        "balanced (every expert the same share of the token choices), worst (every token to the same top-k "
        "experts) or loads=W0,W1,... (a weight per expert). Fake tensors only (docs/capture.md).",
    )
    options += [routing_option] if routing else []

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def compile_options(command):
    """--compile and --memory-budget for a command that traces or replays a step: the command gets them as one
    argument `compile`, the activation memory budget when compiled and None when eager."""

    @functools.wraps(command)
    def with_compile(*args, compile, memory_budget, **kwargs):
        if memory_budget is not None and not compile:
            raise click.UsageError("--memory-budget needs --compile", ctx=click.get_current_context())
        budget = 1.0 if memory_budget is None else memory_budget
        return command(*args, compile=budget if compile else None, **kwargs)

    budget_option = click.option(
        "--memory-budget",
        type=click.FloatRange(0.0, 1.0),
        default=None,
        help="With --compile: torch._functorch.config.activation_memory_budget, from 0 (recompute in backward "
        "everything the partitioner can) to 1 (keep what min-cut chooses; the default).",
    )
    compile_option = click.option(
        "--compile",
        is_flag=True,
        help="Run the model's forward under torch.compile (Inductor; AOTAutograd's min-cut partitioner); the "
        "trace records what the compiled step allocates. Real tensors only.",
    )
    return compile_option(budget_option(with_compile))


GPU_HELP = f"A GPU of memplan's catalogue ({', '.join(g.name for g in GPUS)}; any case, aliases such as h100 too)"


def gpu_option(what: str, outside: bool = False):
    """--gpu NAME for a command, `what` saying what it does with the GPU; the command gets the name. With `outside`,
    also --outside BYTES, what the GPU holds outside the caching allocator given by hand: the command then gets, as
    `gpu_name`, the GPU with those bytes (gpus.GPU.given_outside) in place of its name."""
    option = click.option("--gpu", "gpu_name", default=None, metavar="NAME", help=f"{GPU_HELP}: {what}")
    if not outside:
        return option

    def decorate(command):
        @functools.wraps(command)
        def with_outside(*args, gpu_name, outside, **kwargs):
            if outside is not None and gpu_name is None:
                raise click.UsageError("--outside needs --gpu", ctx=click.get_current_context())
            named = gpu_name if outside is None else gpu(gpu_name).given_outside(outside)
            return command(*args, gpu_name=named, **kwargs)

        outside_option = click.option("--outside", type=SIZE, default=None, metavar="BYTES", help=OUTSIDE_HELP)
        return option(outside_option(with_outside))

    return decorate


OUTSIDE_HELP = (
    "What the GPU holds outside PyTorch's caching allocator (804061184, 800MiB), as `total_memory - "
    "torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()` reads it after a step: it replaces the CUDA "
    "context's measured or estimated figure and NCCL's (the verdict names it 'given'). Needs --gpu."
)
TORCH_HELP = (
    f"The torch the step will run on: {', '.join(r.version for r in RELEASES)} (default {INSTALLED.version}, the one "
    "memplan is installed with). A --fake CUDA step takes its attention kernel rules and cuBLAS workspace, the "
    "verdict its measured outside terms (docs/torch-versions.md)."
)


def torch_option(command):
    """--torch VERSION for a command that plans a CUDA step: the command gets `torch_version` (None: installed)."""
    return click.option("--torch", "torch_version", default=None, metavar="VERSION", help=TORCH_HELP)(command)


def plans_option(text: str):
    """--plan PLAN, repeatable, for a command of several traces (the command gets `plan_files`)."""
    return click.option("--plan", "plan_files", multiple=True, type=click.Path(dir_okay=False), help=text)


def output_option(text: str, required: bool = False):
    """-o/--output FILE for a command that writes one file (the command gets `output`), `text` saying what it writes."""
    if required:  # click enforces required only without an explicit default
        return click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help=text)
    return click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help=text)


def cuda_device_option(what: str):
    """--device N for a command that reads a snapshot (the command gets `cuda_device`)."""
    text = f"CUDA device whose trace to {what} (default: the one with the most entries)."
    return click.option("--device", "cuda_device", type=click.IntRange(min=0), default=None, help=text)


def find_gpu(name: str | GPU | None) -> GPU | None:
    """The catalogue's GPU called `name` (None for None; a GPU stays itself: --outside made it); an unknown name is
    one `Error:` line, exit code 1."""
    return name if name is None or isinstance(name, GPU) else gpu(name)


def memory_or_gpu(memory: int | None, gpu_name: str | None) -> None:
    """A usage error unless exactly one of --memory and --gpu is given."""
    if (memory is None) == (gpu_name is None):
        raise click.UsageError("give --memory SIZE or --gpu NAME (exactly one)", ctx=click.get_current_context())


host_bandwidth_option = click.option(
    "--host-bandwidth",
    "host_bandwidth",
    default=None,
    metavar="RATE",
    help="The host link's bandwidth one way (25GB/s, 64GiB/s) for the time an offload mode's transfers add, "
    "where --gpu does not name it (it wins over the GPU's).",
)


def emit(summary: dict, as_json: bool, text: str) -> None:
    """Print a command's summary: the JSON document with --json, the human text otherwise."""
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else text)


def progress(message: str) -> None:
    """Progress lines go to stderr so that --json output on stdout stays parseable."""
    click.echo(message, err=True)


@click.group(cls=MemplanGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Show the tracebacks that torch, transformers and accelerate log during a capture (MEMPLAN_VERBOSE=1).",
)
def main(verbose: bool) -> None:
    """memplan: trace a training step, plan its memory, replay and simulate it, and plot it."""
    if verbose:
        os.environ["MEMPLAN_VERBOSE"] = "1"  # the capture reads it, in this process and in --nproc's ranks


every_rank_option = click.option(
    "--every-rank",
    is_flag=True,
    help="With --nproc --fake: trace every rank, even those alike by construction.",
)


@main.command("trace")
@click.argument("model_file", type=MODEL_FILE)
@output_option("Trace file to write (default: <model>.<layers>.trace.json.gz).")
@step_options(batch=True, layers=True, loss=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option(
    "--fake",
    is_flag=True,
    help="Build and step the model under fake tensors: nothing is allocated or computed, so any size "
    "traces in seconds, and --device cuda needs no GPU.",
)
@gpu_option(
    "the GPU a --fake CUDA step is planned for (implies --device cuda): its compute capability picks "
    "the attention backend and the cuBLAS workspace, torch.cuda answers for it [default: H100-80GB]."
)
@torch_option
@host_bandwidth_option
@click.option("--top", type=click.IntRange(min=0), default=5, show_default=True, help="Largest buffers to list.")
@click.option(
    "--warmup",
    type=click.IntRange(0, 1),
    default=1,
    show_default=True,
    help="Steps before the recorded one: 1 records the steady state (the optimizer's state made before it), 0 the "
    "first step (the optimizer creates its state inside the window).",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="Run N processes under torch.distributed (gloo on cpu, NCCL on cuda) and write one trace "
    "per rank, FILE.rank{r}.json.gz; all or none. With --fake, the ranks run in turn in this "
    "process on torch.distributed's fake process group, and ranks alike by construction are traced once "
    '(one file each, meta "ranks" the ranks it stands for).',
)
@every_rank_option
@compile_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def trace_command(
    model_file,
    output,
    batch,
    seq,
    dtype,
    layers,
    loss,
    optimizer,
    max_parameters,
    routing,
    device,
    fake,
    gpu_name,
    torch_version,
    host_bandwidth,
    top,
    warmup,
    nproc,
    every_rank,
    compile,
    as_json,
):
    """Record one training step of MODEL_FILE and write its trace.

    Example: memplan trace examples/bert.py --batch 2 --seq 128 -o bert.trace.json.gz

    Example (fake tensors, a CUDA step on any machine):
    memplan trace examples/llama.py --fake --device cuda --dtype bfloat16 --seq 2048

    Example (tensor + sequence parallel, one trace per rank):
    MEMPLAN_PARALLEL=tp+sp memplan trace examples/gpt2_parallel.py --nproc 2 --seq 64 -o gpt2.json.gz

    Example (8 fake ranks of GPT-2 medium, no process or memory needed):
    MEMPLAN_PRESET=medium memplan trace examples/gpt2_parallel.py --nproc 8 --fake --seq 1024 -o m.json.gz

    Example (compiled by Inductor, recomputing in backward all it can):
    memplan trace examples/llama.py --compile --memory-budget 0 -o llama.compiled.json.gz
    """
    from memplan.planner.jobs.trace import trace_to_file
    from memplan.planner.report.trace_text import render_trace_file

    require_fake_for_routing(routing, fake)
    step = StepSpec(model_file, batch, seq, dtype, device, layers, fake, compile, bool(warmup), loss=loss,
                    routing=routing, optimizer=optimizer, torch=torch_version,
                    max_parameters=max_parameters)  # fmt: skip
    step = step.on_gpu(gpu_name)
    bandwidth = None if host_bandwidth is None else parse_bandwidth(host_bandwidth)
    summary = trace_to_file(
        step, output, top=top, nproc=nproc, progress=progress, host_bandwidth=bandwidth, every_rank=every_rank
    )
    emit(summary, as_json, render_trace_file(summary))


@main.command("import")
@click.argument("snapshot", type=click.Path(dir_okay=False))
@output_option("Trace file to write (default: <snapshot>.trace.json.gz).")
@cuda_device_option("import")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def import_command(snapshot, output, cuda_device, as_json):
    """Turn a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) into a trace.

    The pickle is read with a restricted unpickler: plain containers and scalars only.

    Example: memplan import snapshot.pickle -o step.trace.json.gz
    """
    from memplan.planner.jobs.files import import_file
    from memplan.planner.report.trace_text import render_import

    summary = import_file(snapshot, output, cuda_device, progress)
    emit(summary, as_json, render_import(summary))


@main.command("explain")
@click.argument("snapshot", type=click.Path(dir_okay=False))
@gpu_option("the GPU the program ran on: the error's total capacity, the program simulated with all of it, and "
            "without an error the headroom on it.")  # fmt: skip
@click.option("--memory", type=SIZE, default=None, help="The GPU's memory (80GB, 150109880320) instead of --gpu.")
@click.option(
    "--outside",
    type=SIZE,
    default=None,
    help="What the program's process holds outside the caching allocator (its CUDA context, library handles; "
    "default: --gpu's estimate, 0 with --memory).",
)
@cuda_device_option("explain")
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
def explain_command(snapshot, gpu_name, memory, outside, cuda_device, as_json):
    """Explain a CUDA memory snapshot (torch.cuda.memory._dump_snapshot): for one that ends in an out-of-memory
    error, the error with PyTorch's figures, what was live, the fragmentation, and which allocator changes would
    have let it run, each checked by simulating the program; otherwise its peak and the headroom on --gpu.

    \b
    Example: memplan explain oom.pickle --gpu H200
    Example: memplan explain step.pickle --memory 80GB --outside 600MiB --json
    """
    from memplan.planner.jobs.explain import explain_snapshot
    from memplan.planner.report.explain_text import render_explain

    if gpu_name is not None and memory is not None:
        raise click.UsageError("give --gpu NAME or --memory SIZE, not both", ctx=click.get_current_context())
    progress(f"reading {snapshot}")
    result = explain_snapshot(snapshot, find_gpu(gpu_name), memory, outside, cuda_device).to_dict()
    emit(result, as_json, render_explain(result))


@main.command("check", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@gpu_option("the GPU the script runs on (default H100-80GB).", outside=True)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Optimizer steps the script runs before it is stopped (counted as Optimizer.step returns).",
)
@click.option("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the simulated caching allocator.")
@torch_option
@output_option("Write the program as a trace file: its last step, the whole program with it (steps marked).")
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks of a script that starts its own (torchrun's and accelerate launch's are read from them).",
)
@click.option(
    "--cpu-limit",
    type=SIZE,
    default="256MiB",
    show_default=True,
    help="The largest real CPU tensor: CPU work runs for real, and a CPU tensor larger than this is fake (counted).",
)
@click.option(
    "--html",
    "page",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the whole program as one page: memory over time, reserved against the allocator's limit, each step "
    "and each out-of-memory error marked (a .html file).",
)
@click.option(
    "--largest",
    "vary",
    metavar="NAME",
    default=None,
    help="The largest value of the script's own integer option NAME (batch-size for --batch-size) that fits: each "
    "value checked in a process of its own, from the command's value, doubled or halved, then bisected.",
)
@click.option("--rank", "rank_of", default=None, hidden=True, help="R/N: run rank R of N here (how ranks start).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def check_command(
    gpu_name, steps, alloc_conf, torch_version, output, nproc, cpu_limit, page, vary, rank_of, as_json, command
):  # fmt: skip
    """Run your own training script, unmodified, on a fake GPU for its first steps: does it fit, or where does it
    run out of memory? CUDA is memplan's fake device of that GPU (nothing is computed, any size runs); PyTorch's
    caching allocator is simulated as the program runs, so torch.cuda's memory statistics answer from it and a
    request it cannot serve raises torch.OutOfMemoryError in the script, as the GPU would.

    \b
    Example: memplan check --gpu H100 -- python train.py --batch-size 8
    Example: memplan check --gpu H200 --steps 2 --alloc-conf expandable_segments:True -- train.py
    Example: memplan check --gpu H100 -- torchrun --nproc-per-node 8 train_fsdp.py
    Example: memplan check --gpu H100 --largest batch-size -- python train.py --batch-size 8
    """
    from memplan.planner.jobs.check import CheckOptions, check_program, save_program
    from memplan.planner.jobs.check_page import page_path, write_page
    from memplan.planner.report.check_text import render_check

    target = find_gpu(gpu_name or "H100-80GB")
    rank = tuple(int(x) for x in rank_of.split("/")) if rank_of else None
    page = None if page is None else page_path(page)
    options = CheckOptions(tuple(command), target, steps, alloc_conf, torch_version, nproc, rank, cpu_limit,
                           html=page is not None)  # fmt: skip
    if vary is not None:
        from memplan.planner.jobs.check_search import largest
        from memplan.planner.report.check_text import render_search

        search = largest(options, vary, progress)
        if output is not None and search.largest is not None:
            save_program(search.answer, output)
        if page is not None:
            write_page(search.answer, page)
        emit(search.to_dict(), as_json, render_search(search.to_dict()))
        sys.exit(0 if search.largest is not None else 3)
    progress(f"running {' '.join(command)} on a fake {target.name} for {steps} optimizer steps")
    # with --json, stdout is the JSON document alone: the script's own output goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = check_program(options)
    if output is not None:
        save_program(result, output)
    if page is not None:
        write_page(result, page)
    summary = result.to_dict()
    emit(summary, as_json, render_check(summary))
    if not result.fits:
        sys.exit(3)


ALLOC_CONF_HELP = (
    "PYTORCH_CUDA_ALLOC_CONF string for the simulated caching allocator, e.g. "
    "'max_split_size_mb:128,roundup_power2_divisions:4' (default: PyTorch's defaults)."
)
capture_option = click.option(
    "--capture",
    type=click.Choice(["auto", "real", "fake"]),
    default="auto",
    show_default=True,
    help="Trace real or fake tensors; auto: fake where a real step would be slow on a CPU or would not fit "
    "this machine (docs/capture.md: Choosing real or fake traces).",
)


def nproc_option(what: str):
    """--nproc N and --every-rank for a command that runs a model file's step (run, fit): a distributed model file on
    N ranks."""

    def decorate(function):
        function = every_rank_option(function)
        return click.option(
            "--nproc",
            type=click.IntRange(min=1),
            default=None,
            help=f"Trace a distributed model file on N ranks (as memplan trace --nproc; auto: the fake process group, "
            f"real: a process per rank) and {what}",
        )(function)

    return decorate


fake_option = click.option("--fake", is_flag=True, help="The same as --capture fake.")


def capture_of(capture: str, fake: bool) -> str:
    """--capture as --fake leaves it; a usage error for --fake with --capture real."""
    if fake and capture == "real":
        raise click.UsageError("--fake and --capture real exclude each other", ctx=click.get_current_context())
    return "fake" if fake else capture


tie_break_option = click.option(
    "--tie-break",
    type=click.Choice(TIE_BREAKS),
    default=TIE_BREAKS[0],
    show_default=True,
    help="Which of several free blocks of the same size the simulated allocator takes: "
    "older PyTorch builds take the lowest address, newer ones the oldest segment.",
)


@main.command("simulate")
@click.argument("trace_file", type=click.Path(dir_okay=False))
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(dir_okay=False),
    help="Plan of this trace (from memplan solve): checked against the trace, arena reported.",
)
@click.option("--alloc-conf", default="", help=ALLOC_CONF_HELP)
@tie_break_option
@click.option(
    "--capacity",
    type=SIZE,
    default=None,
    help="Device capacity (16GiB, 80GB or bytes): the allocator's out-of-memory retry and failure are simulated.",
)
@gpu_option("whether the step fits it (the caching allocator at its memory less the CUDA context, the cuBLAS "
            "workspaces and NCCL's buffers) and, when not, at which op it runs out of memory.",
            outside=True)  # fmt: skip
@click.option(
    "--timeline",
    type=click.Path(dir_okay=False),
    help="Write the per-event series (time, phase, live, allocated, reserved, plan) as CSV.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Also run the step N times in a row, as a training loop does, and give the caching allocator's peaks on "
    "the last run (the cache as the program reaches its step); 1: from an empty cache only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def simulate_command(trace_file, plan_file, alloc_conf, tie_break, capacity, gpu_name, timeline, steps, as_json):
    """Simulate TRACE_FILE on PyTorch's caching allocator (and on a plan): bound, arena, peaks; with --gpu,
    whether the step fits that GPU.

    \b
    Example: memplan simulate bert.trace.json.gz --plan bert.plan.json --timeline bert.csv
    Example: memplan simulate llama.trace.json.gz --gpu H100-80GB --alloc-conf expandable_segments:True
    """
    from memplan.planner.jobs.files import simulate_file
    from memplan.planner.report.memory_report import report_text

    summary = simulate_file(trace_file, plan_file, alloc_conf=alloc_conf, tie_break=tie_break, capacity=capacity,
                            timeline=timeline, progress=progress, gpu=find_gpu(gpu_name), steps=steps)  # fmt: skip
    emit(summary.to_dict(), as_json, report_text(summary))


@main.command("export")
@click.argument("trace_file", type=click.Path(dir_okay=False))
@output_option("Snapshot to write: a .pickle (default: <trace>.pickle).")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(dir_okay=False),
    help="Plan of this trace (from memplan solve), checked against it: addresses are its offsets in one arena segment.",
)
@click.option("--alloc-conf", default="", help=ALLOC_CONF_HELP)
@tie_break_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def export_command(trace_file, output, plan_file, alloc_conf, tie_break, as_json):
    """Write TRACE_FILE as a PyTorch memory snapshot, for pytorch.org/memory_viz and torch.cuda._memory_viz.

    Addresses, blocks and segments are the simulated caching allocator's (or the plan's); every allocation's stack
    names its buffer, op, module, phase and category.

    \b
    Example: memplan export gpt2.trace.json.gz -o gpt2.pickle
    """
    from memplan.planner.jobs.export import export_file
    from memplan.planner.report.export_text import render_export

    if plan_file and (alloc_conf or tie_break != TIE_BREAKS[0]):
        raise click.UsageError("--alloc-conf and --tie-break set the simulated caching allocator, not a --plan")
    summary = export_file(trace_file, output, plan_file, alloc_conf=alloc_conf, tie_break=tie_break, progress=progress)
    emit(summary, as_json, render_export(summary))


@main.command("plot")
@click.argument("trace_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@plans_option("Plan of one of the traces (matched by trace digest); repeat for several.")
@output_option("Figure to write: .png or .svg.", required=True)
@click.option("--address-space", is_flag=True, help="Also draw each plan's buffers as rectangles (time by offset).")
@click.option("--alloc-conf", default="", help=ALLOC_CONF_HELP)
@tie_break_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def plot_command(trace_files, plan_files, output, address_space, alloc_conf, tie_break, as_json):
    """Plot memory over time: live bytes by category, phases, caching allocator and plan; traces side by side.

    \b
    Example: memplan plot bert.baseline.trace.json.gz bert.tempo.trace.json.gz -o bert.png
    """
    from memplan.planner.jobs.files import plot_files

    summary = plot_files(trace_files, plan_files, output, address_space=address_space, alloc_conf=alloc_conf,
                         tie_break=tie_break, progress=progress)  # fmt: skip
    emit(summary, as_json, f"wrote {summary['output']}")


@main.command("report")
@click.argument("trace_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@plans_option("Plan of one of the traces (matched by trace digest, verified against it); repeat for several.")
@gpu_option("each trace's verdict on it, in the report.")
@output_option("Page to write: a .html file.", required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def report_command(trace_files, plan_files, gpu_name, output, as_json):
    """Write one self-contained HTML report of traces and plans: zoomable timelines side by side, every buffer's
    details on hover, the address space, the largest buffers at the peak, per module, the verdict.

    \b
    Example: memplan report bert.baseline.trace.json.gz bert.tempo.trace.json.gz -o bert.html
    """
    import shlex

    from memplan.planner.jobs.files import report_files

    command = shlex.join(["memplan", "report", *trace_files, *(a for p in plan_files for a in ("--plan", p))]
                         + (["--gpu", gpu_name] if gpu_name else []) + ["-o", output])  # fmt: skip
    summary = report_files(trace_files, plan_files, output, gpu=find_gpu(gpu_name), command=command,
                           progress=progress)  # fmt: skip
    emit(summary, as_json, f"wrote {summary['output']} ({summary['bytes']:,} bytes)")


@main.command("compare")
@click.argument("trace_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@plans_option("Plan of one of the traces (matched by trace digest); traces without one get a plan solved here.")
@click.option(
    "--method",
    type=click.Choice(["auto", "greedy"]),
    default="auto",
    show_default=True,
    help="Solver for traces without a plan.",
)
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds per trace for the solver.",
)
@click.option("--alloc-conf", default="", help=ALLOC_CONF_HELP)
@tie_break_option
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def compare_command(trace_files, plan_files, method, time_limit, alloc_conf, tie_break, as_json):
    """Compare traces in one table: peak live, by category at the peak, caching reserved, plan arena, bound.

    \b
    Example: memplan compare bert.baseline.trace.json.gz bert.tempo.trace.json.gz --method greedy
    """
    from memplan.planner.jobs.files import compare_files
    from memplan.planner.report.compare import compare_summary, compare_text

    rows = compare_files(trace_files, plan_files, method=method, time_limit=time_limit,
                         alloc_conf=alloc_conf, tie_break=tie_break, progress=progress)  # fmt: skip
    emit(compare_summary(rows), as_json, compare_text(rows))


@main.command("replay")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.argument("model_file", type=MODEL_FILE)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="The trace the plan was made from (default on cpu: capture the step now; it must be the plan's).",
)
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Consecutive steps to replay.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@step_options(batch=True, layers=True, loss=True, routing=False)
@compile_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def replay_command(
    plan_file,
    model_file,
    trace_file,
    steps,
    device,
    batch,
    seq,
    dtype,
    layers,
    loss,
    optimizer,
    max_parameters,
    compile,
    as_json,
):
    """Run a model's training steps with the plan allocator and check them bitwise against the default one.

    Moves the parameters, optimizer state and inputs into their planned slots first, then reports the
    arena, what was adopted into it and what stayed outside, fallbacks to the system allocator, the
    measured peak (arena top + fallback + outside) and whether loss, every gradient and the parameters
    are bitwise equal to a run with the reference allocator.

    Example: memplan replay bert.plan.json examples/bert.py --batch 2 --seq 128 --steps 3
    """
    from memplan.planner.replay.model_replay import replay_model_file
    from memplan.planner.report.replay_text import render_replay

    step = StepSpec(model_file, batch, seq, dtype, device, layers, compile=compile, loss=loss, optimizer=optimizer,
                    max_parameters=max_parameters)  # fmt: skip
    report = replay_model_file(plan_file, step, trace_file=trace_file, steps=steps, progress=progress)
    summary = report.summary()
    emit(summary, as_json, render_replay(summary))


@main.command("solve")
@click.argument("source", metavar="TRACE_OR_CSV", type=click.Path(dir_okay=False))
@output_option("Write the verified plan here (memplan-plan/1 JSON; MiniMalloc CSV with offsets if it ends in .csv).")
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds for the whole solve.",
)
@click.option(
    "--capacity",
    type=SIZE,
    default=None,
    help="Memory the plan must fit in (16GiB, 80GB or bytes); stop at the first plan that fits, exit 1 if none.",
)
@click.option(
    "--method",
    type=click.Choice(["auto", "greedy", "cpsat"]),
    default="auto",
    show_default=True,
    help="auto: greedy, then exact search and CP-SAT while above the bound.",
)
@click.option(
    "--alignment",
    type=click.IntRange(min=1),
    default=None,
    help="Round sizes and offsets to this many bytes [default: 512 for traces, 1 for CSV].",
)
@click.option(
    "--scope",
    type=click.Choice(["all", "step"]),
    default="all",
    show_default=True,
    help="all: place every buffer; step: only the step's own, leaving parameters, optimizer "
    "state and inputs (alive the whole step) to the allocator that made them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def solve_command(source, output, time_limit, capacity, method, alignment, scope, as_json):
    """Assign every buffer of a trace (or MiniMalloc CSV) a byte offset; print arena, bound and status.

    Example: memplan solve bert.trace.json.gz -o bert.plan.json --time-limit 5
    """
    from memplan.planner.jobs.solve_file import solve_file
    from memplan.planner.report.solve_text import render_solve

    report = solve_file(
        source,
        output,
        method=method,
        time_limit=time_limit,
        capacity=capacity,
        alignment=alignment,
        scope=scope,
        progress=progress,
    )
    summary = report.summary()
    emit(summary, as_json, render_solve(summary))


@main.command("run")
@click.argument("model_file", required=False, type=MODEL_FILE)
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(file_okay=False),
    default="memplan-out",
    show_default=True,
    help="Folder for report.md, timeline.png, address_space.png, traces/ and plans/.",
)
@step_options(batch=True, loss=True)
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds for each solve.",
)
@click.option(
    "--replay-steps",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Steps the tempo plan is replayed for.",
)
@click.option(
    "--layers",
    "modes",
    multiple=True,
    help="Layer mode to run; repeat for several [default: every mode; with --nproc, as-built]. " + LAYERS_HELP,
)
@capture_option
@fake_option
@nproc_option("show each distinct rank's figures side by side (no replay: it runs one process's step).")
@gpu_option("each mode's verdict: whether its step fits the GPU, or where it runs out of memory.", outside=True)
@torch_option
@compile_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def run_command(
    model_file, out_dir, batch, seq, dtype, loss, optimizer, max_parameters, routing, time_limit, replay_steps, modes,
    capture, fake, nproc, every_rank, gpu_name, torch_version, compile, as_json
):  # fmt: skip
    """The main job: trace MODEL_FILE under every layer mode (as-built, baseline, tempo, selective,
    tempo+selective, full, tempo+full), solve and simulate each, replay the tempo plan on the CPU, and
    write a report with two pictures. With fake traces there is no replay (it runs the real step).

    Without MODEL_FILE it runs the bundled 2-layer slice of BERT-Large (planner/workloads/bert_large_slice.py).

    \b
    Example: memplan run -o memplan-out && open memplan-out/report.md
    Example: memplan run examples/llama_pipeline.py --nproc 4 --fake --batch 8 --seq 16 -o pp-out
    """
    import os

    from memplan.modes import AS_BUILT
    from memplan.planner.jobs.run import DEFAULT_MODEL, RunOptions, run, run_modes
    from memplan.planner.report.run_report import render_text

    capture = capture_of(capture, fake)
    require_fake_for_routing(routing, capture != "real")
    step = StepSpec(model_file or os.path.relpath(DEFAULT_MODEL), batch, seq, dtype, compile=compile, loss=loss,
                    routing=routing, optimizer=optimizer, torch=torch_version,
                    max_parameters=max_parameters)  # fmt: skip
    modes = tuple(modes) or ((AS_BUILT,) if nproc is not None else ())
    opts = RunOptions(step, out_dir, time_limit=time_limit, replay_steps=replay_steps, capture=capture,
                      gpu=find_gpu(gpu_name), nproc=nproc, every_rank=every_rank, **run_modes(modes))  # fmt: skip
    result = run(opts, progress=progress)
    summary = result.summary()
    emit(summary, as_json, render_text(summary))


@main.command("fit")
@click.argument("model_file", type=MODEL_FILE)
@click.option("--memory", type=SIZE, default=None, help="Device memory: 11GiB, 16GB, 512MiB or a number of bytes.")
@gpu_option("fit its memory less what it holds outside the caching allocator (instead of --memory).", outside=True)
@torch_option
@click.option(
    "--layers",
    "modes",
    multiple=True,
    help="Layer mode to fit; repeat for several [default: every mode; with --nproc, as-built]. " + LAYERS_HELP,
)
@step_options(loss=True)
@click.option("--alloc-conf", default="", help=ALLOC_CONF_HELP)
@tie_break_option
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds for each solve.",
)
@capture_option
@fake_option
@nproc_option("fit every rank: a batch fits only if it fits on every rank; the tightest rank is named.")
@compile_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def fit_command(
    model_file, memory, gpu_name, torch_version, modes, seq, dtype, loss, optimizer, max_parameters, routing,
    alloc_conf, tie_break, time_limit, capture, fake, nproc, every_rank, compile, as_json
):  # fmt: skip
    """The largest batch size whose training step fits --memory (or --gpu), under the caching allocator and under
    a plan.

    Traces batch 1, 2 and 4, fits memory as affine in the batch, predicts, brackets the answer and
    narrows the bracket until it is proven: b fits and b+1 does not, both by direct trace.

    \b
    Example: MEMPLAN_PRESET=tiny memplan fit examples/bert.py --memory 64MiB --seq 64 --layers baseline --layers tempo
    Example: MEMPLAN_PRESET=small memplan fit examples/gpt2.py --gpu L4 --seq 1024 --layers tempo --capture fake
    Example: memplan fit examples/llama_fsdp2.py --nproc 8 --fake --gpu H100 --seq 2048
    """
    from memplan.modes import AS_BUILT, SWEPT_MODES
    from memplan.planner.jobs.fit import fit_model
    from memplan.planner.report.fit_table import render_fit

    memory_or_gpu(memory, gpu_name)
    capture = capture_of(capture, fake)
    require_fake_for_routing(routing, capture != "real")
    result = fit_model(
        StepSpec(
            model_file,
            seq=seq,
            dtype=dtype,
            compile=compile,
            loss=loss,
            routing=routing,
            optimizer=optimizer,
            torch=torch_version,
            max_parameters=max_parameters,
        ),
        memory,
        gpu=find_gpu(gpu_name),
        modes=tuple(modes) or ((AS_BUILT,) if nproc is not None else SWEPT_MODES),
        alloc_conf=alloc_conf,
        time_limit=time_limit,
        tie_break=tie_break,
        capture=capture,
        progress=progress,
        nproc=nproc,
        every_rank=every_rank,
    )
    summary = result.summary()
    emit(summary, as_json, render_fit(summary))


def budget_list(_ctx, _param, value: str) -> tuple[float, ...]:
    """--budgets '1,0.5,0.2,0' as floats from 0 to 1 ('' for none)."""
    try:
        budgets = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: a comma-separated list of numbers from 0 to 1") from None
    if any(not 0.0 <= b <= 1.0 for b in budgets):
        raise click.BadParameter(f"{value!r}: every budget is from 0 to 1")
    return budgets


@main.command("tradeoff")
@click.argument("model_file", type=MODEL_FILE)
@step_options(batch=True)
@click.option(
    "--budgets",
    default="1,0.5,0.2,0",
    show_default=True,
    callback=budget_list,
    help="torch.compile activation memory budgets to measure ('' for none).",
)
@click.option("--time-limit", type=click.FloatRange(min=0.1), default=5.0, show_default=True, help="Seconds per plan.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed steps per point.")
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Another model file of the same model built another way (examples/gpt2_reversible.py), measured as built "
    "at the same shape and drawn with the rest; repeatable.",
)
@click.option(
    "--actions/--no-actions",
    default=True,
    show_default=True,
    help="Also measure each action alone on the model as built: the fused loss and each --optimizer choice the step "
    "does not fix, and the offload modes with --host-bandwidth (or a --fake CUDA step's GPU).",
)
@host_bandwidth_option
@capture_option
@gpu_option(
    "trace fake CUDA steps on it, and show each mode's step time measured on it where this model and shape were "
    "(planner/cost/measured_times.json)."
)
@output_option("Figure to write: .png or .svg.")
@click.option("--json", "as_json", is_flag=True, help="Print every point as JSON.")
def tradeoff_command(
    model_file,
    batch,
    seq,
    dtype,
    optimizer,
    max_parameters,
    routing,
    budgets,
    time_limit,
    repeats,
    variants,
    actions,
    host_bandwidth,
    capture,
    gpu_name,
    output,
    as_json,
):
    """Peak memory against extra compute for every layer mode, action (the fused loss, each optimizer choice, and
    activation offload with --host-bandwidth) and torch.compile budget, Pareto frontier marked.

    Example: memplan tradeoff examples/gpt2.py --budgets 1,0 --variant examples/gpt2_reversible.py -o tradeoff.png
    """
    from memplan.planner.jobs.tradeoff import TradeoffOptions, tradeoff
    from memplan.planner.report.tradeoff_table import render_tradeoff

    require_fake_for_routing(routing, capture != "real")
    step = StepSpec(
        model_file, batch, seq, dtype, routing=routing, optimizer=optimizer, max_parameters=max_parameters
    ).on_gpu(find_gpu(gpu_name))
    bandwidth = None if host_bandwidth is None else parse_bandwidth(host_bandwidth)
    opts = TradeoffOptions(step, budgets, time_limit, repeats, capture, output, variants, actions, bandwidth)
    result = tradeoff(opts, progress=progress)
    summary = result.summary()
    emit(summary, as_json, render_tradeoff(summary))


def layer_mode_list(_ctx, _param, value: str | None) -> tuple[str, ...] | None:
    """--modes 'as-built,tempo,full' as per-layer mode names (None: optimize's default)."""
    if value is None:
        return None
    names = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    wrong = [n for n in names if n not in PER_LAYER_MODES]
    if wrong or not names:
        raise click.BadParameter(f"{value!r}: a comma-separated list of per-layer modes ({', '.join(PER_LAYER_MODES)})")
    return names


@main.command("optimize")
@click.argument("model_file", type=MODEL_FILE)
@click.option("--memory", type=SIZE, default=None, help="Memory the plan must fit: 11GiB, 16GB, 512MiB or bytes.")
@gpu_option("fit its memory less what it holds outside the caching allocator (instead of --memory).", outside=True)
@torch_option
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Batch size passed to build() [default: 2].")
@click.option("--max-batch", is_flag=True, help="Choose the largest batch that fits too.")
@step_options(loss=True)
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds for CP-SAT and per plan.",
)
@click.option(
    "--actions/--no-actions",
    default=True,
    show_default=True,
    help="Also choose the actions beyond the layer modes: the fused loss and an --optimizer choice where the step "
    "does not fix them, and with a host link (--gpu or --host-bandwidth) the offloading modes and the host optimizer.",
)
@host_bandwidth_option
@click.option(
    "--modes",
    default=None,
    callback=layer_mode_list,
    metavar="M1,M2,...",
    help="The layer modes each layer may take [default: as-built, tempo, selective, tempo+selective, full, and the "
    "offloading modes with --actions and a host link]: fewer modes, fewer traces.",
)
@click.option(
    "--every-context",
    is_flag=True,
    help="Trace every pair of modes at every layer (M² traces for M modes), even where the layers are alike and "
    "walks through the modes measure them in fewer.",
)
@capture_option
@output_option("Choice file to write (memplan-choice/1): memplan.apply(model, optimizer, FILE) puts it on your model.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def optimize_command(
    model_file,
    memory,
    gpu_name,
    torch_version,
    batch,
    max_batch,
    seq,
    dtype,
    loss,
    optimizer,
    max_parameters,
    routing,
    time_limit,
    actions,
    host_bandwidth,
    modes,
    every_context,
    capture,
    output,
    as_json,
):
    """A mode per Transformer layer, the loss and the optimizer, so the step fits --memory (or --gpu) with the least
    added step time (recompute, host transfers), chosen by CP-SAT on a model measured from traces and checked by
    tracing it.

    \b
    Example: memplan optimize examples/gpt2.py --memory 7MiB --batch 2 --seq 128
    Example: MEMPLAN_PRESET=medium memplan optimize examples/gpt2.py --gpu A100-40GB --max-batch --seq 1024
    """
    from memplan.planner.jobs.optimize import OptimizeError, OptimizeOptions, optimize
    from memplan.planner.optimize.choice_file import save_choice
    from memplan.planner.report.optimize_text import render_optimize

    if max_batch and batch is not None:
        raise click.UsageError("--batch and --max-batch exclude each other", ctx=click.get_current_context())
    memory_or_gpu(memory, gpu_name)
    require_fake_for_routing(routing, capture != "real")
    step = StepSpec(model_file, 1 if max_batch else batch or 2, seq, dtype, loss=loss, routing=routing,
                    optimizer=optimizer, torch=torch_version, max_parameters=max_parameters)  # fmt: skip
    bandwidth = None if host_bandwidth is None else parse_bandwidth(host_bandwidth)
    gpu = find_gpu(gpu_name)
    opts = OptimizeOptions(
        step, memory, max_batch, capture, time_limit, gpu, actions, bandwidth, modes, alike=not every_context
    )
    result = optimize(opts, progress=progress)
    summary = result.summary()
    if output is not None:
        choice = result.step_choice()
        if choice is None:
            raise OptimizeError(f"no assignment's traced plan fits {human_bytes(opts.memory)}: {output} not written")
        save_choice(choice, output)
        summary["choice_file"] = output
    emit(summary, as_json, render_optimize(summary))


if __name__ == "__main__":
    sys.exit(main())
