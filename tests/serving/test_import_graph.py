"""The modules of a package import each other as a DAG: no circle, not even through an import
inside a function (a lazy import hides a circle from Python, not from the design: two modules
that need each other are one module, or a third one is missing).

The graph is read from the source, so a circle is found whether or not any code path runs it:
every ``from .x import`` / ``from . import x`` / ``import pagedllm.<package>.x`` anywhere in a
module is an edge to x. Run over ``serving/`` and ``reference/engine/``.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"serving": "pagedllm.serving", "reference/engine": "pagedllm.reference.engine"}


def module_name(package_dir: Path, path: Path) -> str:
    """"a.b" for package_dir/a/b.py and package_dir/a/b/__init__.py; "" for the package."""
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(node: ast.AST, here: str, is_package: bool, absolute: str) -> list[str]:
    """The modules of the package that one import statement names, relative to its root.
    ``here``: the importing module's name; ``absolute``: the package's dotted import name."""
    if isinstance(node, ast.Import):
        return [alias.name.removeprefix(absolute + ".") for alias in node.names
                if alias.name.startswith(absolute + ".")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        if node.module == absolute:  # from pagedllm.serving import x
            return [alias.name for alias in node.names]
        if node.module and node.module.startswith(absolute + "."):
            return [node.module.removeprefix(absolute + ".")]
        return []
    # Relative: level 1 is the importing module's own package (itself, for an __init__).
    package = here.split(".") if here else []
    if not is_package:
        package = package[:-1]
    if node.level - 1 > len(package):
        return []  # above the package's root: outside it
    base = package[:len(package) - (node.level - 1)]
    if node.module:
        return [".".join(base + node.module.split("."))]
    return [".".join(base + [alias.name]) for alias in node.names]  # from . import x


def import_graph(package_dir: Path, absolute: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (anywhere in its source). An edge
    to a name that is not a module (``from .x import y`` where y is a function) goes to x."""
    files = {module_name(package_dir, path): path for path in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            for target in imported_modules(node, name, path.name == "__init__.py", absolute):
                while target and target not in files:  # "x.func" -> "x"
                    target = target.rpartition(".")[0]
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, ..., a], or None (a depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the stack, "done" once all below are seen
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_a_package_imports_itself_as_a_dag(folder):
    graph = import_graph(ROOT / folder, PACKAGES[folder])
    assert len(graph) > 3  # the package was read, not an empty folder
    cycle = find_cycle(graph)
    assert cycle is None, f"{folder}/ imports in a circle: {' -> '.join(cycle)}"


def test_the_checker_finds_a_lazy_circle_and_passes_a_dag(tmp_path):
    """The checker itself: a circle closed by an import inside a function is found, whether
    relative or absolute; the same modules without that import pass."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .c import f\n")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("import pagedllm.pkg.sub.c\n")
    closing = package / "sub" / "c.py"
    closing.write_text("def f():\n    from ..a import thing\n")
    graph = import_graph(package, "pagedllm.pkg")
    assert graph == {"": set(), "a": {"b"}, "b": {"sub.c"}, "sub": {"sub.c"}, "sub.c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "sub.c", "a"]
    closing.write_text("def f():\n    from pagedllm.pkg import a\n")
    assert find_cycle(import_graph(package, "pagedllm.pkg")) == ["a", "b", "sub.c", "a"]
    closing.write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(package, "pagedllm.pkg")) is None
