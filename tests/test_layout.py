"""The package's shape, read from its own imports: no import cycles, and each layer imports only what lies below it.

Every import counts: at module level, inside functions, and under `if TYPE_CHECKING:`. An import names the module
it loads (`from .data.types import ImageSet` is an edge to scaletrain.data.types, `from . import faults` to
scaletrain.training.faults, `from ..data import ImageSet` to the package scaletrain.data itself).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import scaletrain
from scaletrain.cli import build_parser
from scaletrain.data import sources
from scaletrain.training.epoch import train_one_epoch
from scaletrain.training.loop import fit

ROOT = Path(scaletrain.__file__).parent
# What the top level keeps: the entry points, and what every layer shares.
TOP_LEVEL = {"__init__", "__main__", "cli", "config", "errors", "metrics", "models", "runfolder", "steps"}
SHARED = {"scaletrain.config", "scaletrain.errors", "scaletrain.metrics", "scaletrain.models", "scaletrain.runfolder",
          "scaletrain.steps"}
LAYERS = ("commands", "data", "inference", "measure", "parallel", "training")
# Only parallel/ may talk to other processes or wrap models for them.
PARALLEL_ONLY = ("accelerate", "torch.distributed", "torch.nn.parallel")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether a dotted scaletrain name is a module or package of the source tree."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports (absolute names), wherever in the file the import stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import module` loads the module; `from pkg import name`, pkg
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if candidate.startswith("scaletrain") and _is_module(candidate) else base)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        graph[module_name(path)] = {m for m in imports_of(path) if m == "scaletrain" or m.startswith("scaletrain.")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


GRAPH = import_graph()


def test_the_graph_is_read_from_every_kind_of_import():
    """The reader sees imports inside functions and under TYPE_CHECKING, and resolves relative ones."""
    assert "scaletrain.training.worker" in GRAPH["scaletrain"]  # inside `train()`
    assert "scaletrain.parallel" in GRAPH["scaletrain.training.experiment_log"]  # under TYPE_CHECKING only
    assert "scaletrain.data.sources.cifar" in GRAPH["scaletrain.data.sources"]  # `from . import cifar, ...`
    assert "scaletrain.data.types" in GRAPH["scaletrain.data.sources.idx"]  # `from ..types import ...`


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_top_level_keeps_only_entry_points_and_what_every_layer_shares():
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top <= TOP_LEVEL, (f"new top-level module(s) {sorted(top - TOP_LEVEL)}: put each in its layer's package "
                              f"({', '.join(LAYERS)}); docs/layout.md says which holds what")


def test_what_every_layer_shares_imports_no_layer():
    for module in sorted(SHARED):
        layers = {layer_of(m) for m in GRAPH[module]} - {"top"}
        assert not layers, f"{module} imports from {sorted(layers)}; it must stay below every layer"
        assert not GRAPH[module] - SHARED, f"{module} imports {sorted(GRAPH[module] - SHARED)}"


@pytest.mark.parametrize("layer, forbidden", [
    ("data", {"training", "inference", "measure", "commands"}),
    ("parallel", {"data", "training", "inference", "measure", "commands"}),
    ("training", {"inference", "measure", "commands"}),
    ("inference", {"training", "measure", "commands"}),
    ("measure", {"inference", "commands"}),
])
def test_each_layer_imports_only_what_lies_below_it(layer, forbidden):
    for module, targets in GRAPH.items():
        if layer_of(module) == layer:
            wrong = sorted(t for t in targets if layer_of(t) in forbidden)
            assert not wrong, f"{module} ({layer}/) imports {wrong}"


def test_commands_are_imported_by_the_cli_alone():
    for module, targets in GRAPH.items():
        if layer_of(module) != "commands" and module != "scaletrain.cli":
            wrong = sorted(t for t in targets if layer_of(t) == "commands")
            assert not wrong, f"{module} imports {wrong}: commands/ is imported by nothing but the CLI"


def test_only_parallel_imports_accelerate_and_torch_distributed():
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        if layer_of(module) == "parallel":
            continue
        wrong = sorted(m for m in imports_of(path) if m.startswith(PARALLEL_ONLY))
        assert not wrong, f"{module} imports {wrong}; only scaletrain.parallel may"
    assert any(m.startswith("accelerate") for m in imports_of(ROOT / "parallel" / "runtime.py"))


@pytest.mark.parametrize("function, home", [(fit, "training/outputs.py"), (train_one_epoch, "epoch.Progress")])
def test_the_loop_fits_on_one_screen(function, home):
    lines = len(inspect.getsource(function).splitlines())
    assert lines <= 60, f"{function.__name__} is {lines} lines; what is not a step belongs in {home}"


SECTIONS = {"data", "model", "optim", "run"}


def section_assignments(tree: ast.AST) -> list[int]:
    """Lines that assign to a setting of a config section (`x.optim.lr = ...`, `x.run = ...` on a config) or set
    one with setattr: after resolution nothing may change a run's settings."""
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr in SECTIONS:
                    found.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and node.args and \
                isinstance(node.args[0], ast.Attribute) and node.args[0].attr in SECTIONS:
            found.append(node.lineno)
    return found


def test_the_mutation_finder_finds_what_it_should():
    tree = ast.parse("cfg.optim.lr = 1\nc.run.output_dir, x = 'a', 2\nsetattr(c.data, 'k', 1)\n"
                     "self.run = run\nrun.plan = 3\n")
    assert section_assignments(tree) == [1, 2, 3]


def test_no_code_changes_a_config_section_after_resolution():
    """Settings are resolved once (config.resolve) into read-only sections; no module assigns to a section's
    setting, so none can change a run's settings behind the others' backs (config.py builds them)."""
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "config.py" and path.parent == ROOT:
            continue
        lines = section_assignments(ast.parse(path.read_text()))
        assert not lines, f"{module_name(path)} assigns to a config section's setting at line(s) {lines}"


def test_every_source_has_the_same_small_interface_and_one_line_in_the_table():
    modules = {p.stem for p in Path(sources.__file__).parent.glob("*.py")} - {"__init__"}
    assert {s.__name__.rsplit(".", 1)[1] for s in sources.SOURCES} == modules, "a source module missing from SOURCES"
    for source in sources.SOURCES:
        assert isinstance(source.FORMAT, str), source
        assert all(callable(getattr(source, f, None)) for f in ("named", "recognise", "read")), source
    formats = [s.FORMAT for s in sources.SOURCES if s.FORMAT]
    assert len(formats) == len(set(formats)), f"two sources share a --data-format: {formats}"


def test_data_format_takes_exactly_the_sources_formats():
    train = build_parser().commands["train"]
    action = next(a for a in train._actions if "--data-format" in a.option_strings)
    assert tuple(action.choices) == sources.formats()


# -- benchmarks/: each script is its cases on the harness ----------------------------------------------------------
BENCHMARKS = ROOT.parent.parent / "benchmarks"
TESTS = ROOT.parent.parent / "tests"


def benchmark_imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, top-level module name, relative level) of every import in a benchmark file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0], 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, (node.module or "").split(".")[0], node.level))
    return found


def benchmark_import_problems(path: Path, scripts: set[str], helpers: set[str], tests: set[str]) -> list[str]:
    """What `path` imports beyond the standard library, third-party packages, scaletrain and benchmarks' own `_*`
    modules: another script, a module of tests/, or a relative import."""
    problems = []
    for line, name, level in benchmark_imports(path):
        where = f"benchmarks/{path.name}:{line} imports {name or '.'}"
        if level:
            problems.append(f"{where} (relative)")
        elif name in scripts:
            problems.append(f"{where}, another script: move what both need into a `_` module")
        elif name in tests or name == "tests":
            problems.append(f"{where}, from tests/: move what both need into scaletrain or a `_` module")
        elif name.startswith("_") and name != "__future__" and name not in helpers:
            problems.append(f"{where}, which is not a module of benchmarks/")
    return problems


def benchmark_files() -> tuple[list[Path], set[str], set[str], set[str]]:
    files = sorted(BENCHMARKS.glob("*.py"))
    helpers = {p.stem for p in files if p.stem.startswith("_")}
    tests = {p.stem for p in TESTS.glob("*.py")}
    return files, {p.stem for p in files} - helpers, helpers, tests


def test_benchmarks_import_only_the_harness_scaletrain_and_packages():
    """A benchmark script is its cases on the harness: it imports the standard library, third-party packages,
    scaletrain and benchmarks' own `_*` modules (what runs, reads and records a process is written once there),
    never another script or a module of tests/. (What a benchmark measures, it may import from where it lies: an
    example's classes, a seed's script.)"""
    files, scripts, helpers, tests = benchmark_files()
    assert "_harness" in helpers and "gpu_suite" in scripts
    problems = [p for path in files for p in benchmark_import_problems(path, scripts, helpers, tests)]
    assert not problems, "\n".join(problems)


def test_the_benchmark_rule_finds_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport torch\nimport _harness\nfrom scaletrain import fit\n\n\ndef f():\n"
                   "    from peers import run\n    import helpers\n    from . import x\n    import _nowhere\n")
    problems = benchmark_import_problems(bad, {"peers", "bad"}, {"_harness"}, {"helpers", "test_watch"})
    assert [p.split(":")[1].split()[0] for p in problems] == ["8", "9", "10", "11"], problems


def test_no_import_cycles_among_the_benchmarks():
    files, _, helpers, _ = benchmark_files()
    graph = {p.stem: {name for _, name, _ in benchmark_imports(p) if name in helpers} for p in files}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in benchmarks/: " + " -> ".join(cycle)
