"""The engine's import structure: no cycles between its modules, and no reach into the service.

Every module of nightshift/engine is parsed with `ast`; every import statement counts, at module
level, inside functions and under `if TYPE_CHECKING:` alike (an import hidden in a function is
still a dependency, only a later one). An edge goes to the module an import names: for
`from a.b import c` that is `a.b.c` when `c` is a module of the engine, else `a.b`. The implicit
import of parent packages is not an edge (every submodule would otherwise "import" the package
`__init__` that imports it back).
"""
from __future__ import annotations

import ast
from pathlib import Path

import nightshift.engine

ENGINE_DIR = Path(nightshift.engine.__file__).parent
SERVICE_PACKAGES = ("nightshift.api", "nightshift.jobs", "nightshift.workers", "nightshift.storage",
                    "nightshift.settings", "nightshift.migrations")


def engine_modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ENGINE_DIR.rglob("*.py")):
        parts = list(path.relative_to(ENGINE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(["nightshift.engine", *parts])] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Fully qualified names of everything `module` imports: `import a.b` gives a.b, `from a import
    b` gives a.b (the module a.b, or the attribute b of module a)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = engine_modules()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            if name in modules:
                targets.add(name)
            elif "." in name and name.rsplit(".", 1)[0] in modules:
                targets.add(name.rsplit(".", 1)[0])   # `from pkg.mod import attribute`
        targets.discard(module)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from nightshift.engine.a import A\n"
                      "def f():\n    from nightshift.engine import b\n    import nightshift.engine.c.d\n")
    names = imported_names("nightshift.engine.mod", source)
    assert {"nightshift.engine.a.A", "nightshift.engine.b", "nightshift.engine.c.d"} <= names
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_engine_import_graph_is_acyclic():
    graph = import_graph()
    assert len(graph) > 30 and graph["nightshift.engine.engine"]      # the walk found the engine
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_imports_nothing_from_the_service():
    offenders = []
    for module, path in engine_modules().items():
        for name in imported_names(module, path):
            if name.startswith(SERVICE_PACKAGES) or name == "bench" or name.startswith("bench."):
                offenders.append(f"{module} imports {name}")
    assert not offenders, "\n".join(offenders)
