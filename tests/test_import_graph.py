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


def top_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports when it is imported: its top-level statements' imports (those under
    `if TYPE_CHECKING:` are for type checkers alone; those inside functions run when called), each resolved to the
    module it names or, for `from package import name`, to the submodule `name` where there is one."""

    def resolved(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        if isinstance(statement, ast.Import):
            found |= {resolved(alias.name) for alias in statement.names}
        elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
            found |= {resolved(f"{statement.module}.{alias.name}") for alias in statement.names}
    return {name for name in found if name is not None}


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
