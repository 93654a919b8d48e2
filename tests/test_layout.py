"""The package's shape: one `memplan` namespace, every package listed for the wheel, imports that run one
way along the flow (modes/step -> layers -> traces -> problem/plan/verify -> solvers/optimize ->
simulate/replay/cost/report -> jobs -> api/cli/integrations), no import cycle, memplan's own imports inside
functions only where the module is heavy (cli) or CUDA-only, and no mode name spelled outside the registry
(memplan/modes.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("traces", "planner", "solvers", "integrations")
# The flow, earliest first: a module may import its own stage and earlier ones, never a later one.
STAGES = (
    ("memplan.errors", "memplan.units", "memplan.limits", "memplan.files", "memplan.cxx"),  # shared by every stage
    ("memplan.modes", "memplan.routing", "memplan.step", "memplan.gpus", "memplan.torch_versions"),  # modes; fake
    #                                  routing rules; a step; GPUs; the rules of the torch a step runs on
    ("memplan.planner.layers",),  # the layers the modes swap in, and the patcher that applies a mode
    ("memplan.traces",),  # a step of a model file, patched with its mode, recorded
    ("memplan.planner.problem", "memplan.planner.safety", "memplan.planner.verify", "memplan.planner.plan",
     "memplan.planner.minimalloc_csv"),
    ("memplan.planner.workloads", "memplan.planner.parallel"),  # the models memplan bundles
    ("memplan.solvers", "memplan.planner.optimize"),  # placements; the per-layer choice
    ("memplan.planner.simulate", "memplan.planner.replay", "memplan.planner.cost"),  # what a step costs
    ("memplan.planner.report",),
    ("memplan.planner.jobs",),
    ("memplan.api", "memplan.cli", "memplan", "memplan.integrations"),  # integrations: memplan inside HF's Trainer
)  # fmt: skip
INNER_ALLOWED = {"memplan.cli": "each command imports what it runs: `memplan --help` stays fast",
                 "memplan": "the API loads on first use (PEP 562)",
                 "memplan.planner.replay.model_replay": "the CUDA plugin, only for --device cuda"}  # fmt: skip


def module_files() -> dict[str, Path]:
    """memplan module name -> file, for every module the wheel ships."""
    files = {"memplan": ROOT / "__init__.py"}
    files |= {f"memplan.{path.stem}": path for path in sorted(ROOT.glob("*.py")) if path.name != "__init__.py"}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("memplan", *parts)).removesuffix(".__init__")
            files[name] = path
    return files


def imports(path: Path, names: set[str]) -> list[tuple[str, bool]]:
    """(memplan module imported, at module level?) for every import statement of the file."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memplan":
            for alias in node.names:  # `from memplan.x import y` imports memplan.x.y when y is a module
                child = f"{node.module}.{alias.name}"
                found.append((child if child in names else node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name.split(".")[0] == "memplan"]
    return found


def stage(module: str) -> int:
    matches = [(len(prefix), i) for i, group in enumerate(STAGES) for prefix in group
               if module == prefix or module.startswith(prefix + ".")]  # fmt: skip
    assert matches, f"{module} is in no stage of the flow: add it to STAGES"
    return max(matches)[1]


def test_every_package_folder_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"memplan"} | {".".join(("memplan", *p.parent.relative_to(ROOT).parts))
                             for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py")}  # fmt: skip
    assert listed == folders
    for folder in FOLDERS:  # a folder of modules without __init__.py would not be shipped
        for path in (ROOT / folder).rglob("*.py"):
            assert (path.parent / "__init__.py").exists(), f"{path.parent} has modules but no __init__.py"


def test_imports_run_one_way_with_no_cycle():
    files = module_files()
    graph = {name: imports(path, set(files)) for name, path in files.items()}
    for name, found in graph.items():
        for target, at_top in found:
            assert target in files, f"{name} imports {target}, which is not a memplan module"
            assert stage(target) <= stage(name), f"{name} reaches forward into {target}"
            assert at_top or name in INNER_ALLOWED, f"{name} imports {target} inside a function"
    # a cycle among the module-level imports (a package's __init__ re-exporting its own modules is none)
    edges = {name: {t for t, at_top in found if at_top and t != name} for name, found in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path
                            else f"import cycle through {node} -> {nxt}")  # fmt: skip
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(files):
        if name not in state:
            visit(name, [])


# Imports each module named in argv in turn, dropping every memplan module after each, so each runs its imports from
# none loaded; the process keeps each source file's compiled code (Python writes no bytecode here), so a re-import does
# not compile the same text again.
IMPORT_EACH_ALONE = """
import importlib, importlib.machinery, sys
compiled, compile_source = {}, importlib.machinery.SourceFileLoader.source_to_code
def source_to_code(self, data, path, **kwargs):
    if (path, data) not in compiled:
        compiled[path, data] = compile_source(self, data, path, **kwargs)
    return compiled[path, data]
importlib.machinery.SourceFileLoader.source_to_code = source_to_code
for name in sys.argv[1:]:
    importlib.import_module(name)
    for loaded in [m for m in sys.modules if m.startswith("memplan")]:
        del sys.modules[loaded]
"""


@pytest.mark.slow
def test_every_module_imports_alone():
    """Each module imports in a fresh interpreter by itself (an order-dependent cycle would fail here)."""
    names = sorted(module_files())
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, *names], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_public_api_is_listed_and_documented():
    code = "import memplan, sys; print(' '.join(memplan.__all__)); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    names, torch_loaded = done.stdout.split("\n")[:2]
    assert torch_loaded == "False"  # `import memplan` stays light
    import memplan

    assert names.split() == memplan.__all__
    for name in memplan.__all__:
        value = getattr(memplan, name)
        if callable(value) and not isinstance(value, type):
            assert value.__doc__ and value.__doc__.strip(), f"memplan.{name} has no docstring"


def test_no_module_outside_the_registry_spells_a_mode_name():
    """A mode is named by memplan.modes' constants everywhere else, so the registry is its one definition."""
    from memplan.modes import MODES, PARTS, PER_LAYER

    names = {*MODES, *PARTS, PER_LAYER}
    spelled = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for name, path in module_files().items()
        if name != "memplan.modes"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert not spelled, "mode names spelled outside memplan/modes.py:\n" + "\n".join(spelled)
