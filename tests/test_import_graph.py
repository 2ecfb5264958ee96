"""The package's import graph, read from its source (`ast`, nothing imported): no module imports, at its top level,
one that imports it back, however far round. A cycle makes what a module holds depend on which of its members was
imported first (an import that finds the other half-initialised)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import rampserve

ROOT = Path(rampserve.__file__).parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = ("rampserve", *path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _statements(path: Path, everywhere: bool) -> list[ast.stmt]:
    """A module's import statements: its top-level ones (what importing it runs), or every one wherever it stands
    (a function's run when called); never those under `if TYPE_CHECKING:`, which are for type checkers alone."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for statement in ast.walk(tree) if isinstance(statement, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(statement.test) for node in ast.walk(statement)}
    statements = ast.walk(tree) if everywhere else tree.body
    return [s for s in statements if isinstance(s, ast.Import | ast.ImportFrom) and id(s) not in typing_only]


def imports(path: Path, modules: dict[str, Path], everywhere: bool = False) -> tuple[set[str], set[str]]:
    """The package's modules `path` imports, each resolved to the module it names or, for `from package import
    name`, to the submodule `name` where there is one; and the other packages it imports (top-level names)."""

    def resolved(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found, others = set(), set()
    for statement in _statements(path, everywhere):
        if isinstance(statement, ast.Import):
            names = [alias.name for alias in statement.names]
        elif statement.level == 0 and statement.module:
            names = [f"{statement.module}.{alias.name}" for alias in statement.names]
        else:
            continue
        for name in names:
            module = resolved(name)
            found.add(module) if module is not None else others.add(name.partition(".")[0])
    return found, others


def top_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports when it is imported."""
    return imports(path, modules)[0]


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: top_level_imports(path, modules) - {name} for name, path in modules.items()}


def test_no_module_of_rampserve_imports_itself_back():
    graph = import_graph()
    assert len(graph) > 100 and graph["rampserve.serving.server"]  # the package was read, imports resolved
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as cycle:
        pytest.fail(f"an import cycle: {' -> '.join(cycle.args[1])}")


def test_the_graph_would_show_a_cycle(tmp_path):
    """The check itself: two modules importing each other are found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("import pkg.a\nthing = 1\n")
    modules = {"pkg": package / "__init__.py", "pkg.a": package / "a.py", "pkg.b": package / "b.py"}
    graph = {name: top_level_imports(path, modules) - {name} for name, path in modules.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    with pytest.raises(CycleError):
        TopologicalSorter(graph).prepare()


# The front end (and what it shares with the executor) never reaches, by any import, wherever it stands, the
# executor's side, the parts that load and run models, or the libraries they run on: the HTTP server's process
# stays free of torch and ONNX Runtime, and a change on the executor's side cannot reach the front door by import.
FRONT_END = ("rampserve.serving.frontend", "rampserve.serving.shared")
FRONT_END_NEVER_REACHES = ("rampserve.serving.executor", "rampserve.runtime", "rampserve.ramps", "rampserve.graph")
FRONT_END_NEVER_IMPORTS = {"torch", "onnxruntime"}


def reached_from(starts: set[str], modules: dict[str, Path], everywhere: bool = True) -> dict[str, tuple[str, ...]]:
    """Every module reached from `starts` by imports anywhere in them (or only at their top level: what importing them
    runs), and other packages as "pkg:NAME", each with the chain of imports that reaches it."""
    chains = {name: (name,) for name in starts}
    waiting = sorted(starts)
    while waiting:
        name = waiting.pop()
        found, others = imports(modules[name], modules, everywhere=everywhere)
        for other in sorted(found) + [f"pkg:{package}" for package in sorted(others)]:
            if other not in chains:
                chains[other] = (*chains[name], other)
                if not other.startswith("pkg:"):
                    waiting.append(other)
    return chains


def front_end_violations(modules: dict[str, Path]) -> list[str]:
    starts = {name for name in modules if name.startswith(FRONT_END)}
    chains = reached_from(starts, modules)
    return [" -> ".join(chain) for name, chain in sorted(chains.items())
            if name.startswith(FRONT_END_NEVER_REACHES) or name.removeprefix("pkg:") in FRONT_END_NEVER_IMPORTS
            and name.startswith("pkg:")]


def test_the_front_end_imports_nothing_of_the_executor_runtime_ramps_graph_torch_or_onnxruntime():
    modules = module_files()
    assert sum(name.startswith(FRONT_END) for name in modules) > 20  # the packages were found
    assert front_end_violations(modules) == []


def test_the_rule_would_catch_an_import_inside_a_function(tmp_path):
    """The check itself: a front-end module reaching torch through another module's function-local import."""
    (tmp_path / "plane.py").write_text("from rampserve.threads import thing\n")
    (tmp_path / "threads.py").write_text("def thing():\n    import torch.nn\n")
    modules = {"rampserve.serving.frontend.plane": tmp_path / "plane.py", "rampserve.threads": tmp_path / "threads.py"}
    assert front_end_violations(modules) == ["rampserve.serving.frontend.plane -> rampserve.threads -> pkg:torch"]


def test_an_onnx_models_executor_imports_no_torch_when_it_starts():
    """What an executor process imports to serve an ONNX model (`serving.executor.core.MODEL_MODULES`) reaches torch
    by no top-level import: torch loads only where a function that needs it runs (a torch model's bundle, a ramp
    that runs as a torch module; the real executor is held to it by test_front_end)."""
    from rampserve.serving.executor.core import MODEL_MODULES

    chains = reached_from({"rampserve.serving.executor.core", *MODEL_MODULES["onnx"]}, module_files(), everywhere=False)
    assert "rampserve.serving.executor.worker" in chains and "pkg:onnxruntime" in chains  # the graph was followed
    assert chains.get("pkg:torch") is None, " -> ".join(chains["pkg:torch"])
