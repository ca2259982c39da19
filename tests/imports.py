"""What the structure tests read of serval's source: its modules and the serval modules each one imports."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "serval"


def module_name(path: pathlib.Path) -> str:
    """serval/engine/client.py -> serval.engine.client; a package's __init__.py -> the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported_names(path: pathlib.Path, runtime_only: bool = False) -> list[str]:
    """Every module name an import statement of the file names, at any depth (a function-level import counts).
    `from a import b` gives a.b as well as a, since b may be a module. runtime_only: leave out what is imported
    under `if TYPE_CHECKING:` (never imported when the code runs, so it can't close a cycle)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package upwards
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([node.module] if node.module else []))
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """{module: the serval modules it imports when it runs}: a name that is no module of serval's is left out."""
    known = modules()
    graph = {}
    for name, path in known.items():
        graph[name] = {imported for imported in imported_names(path, runtime_only=True) if imported in known}
        graph[name].discard(name)
    return graph
