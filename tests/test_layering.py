"""The layers call downwards only: api -> serving -> engine -> runner. An upward import fails this test."""

from __future__ import annotations

import ast
import pathlib

LAYERS = ["api", "serving", "engine", "runner"]
ROOT = pathlib.Path(__file__).resolve().parent.parent / "serval"


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_no_upward_imports():
    upward = []
    for layer_index, layer in enumerate(LAYERS):
        for path in (ROOT / layer).rglob("*.py"):
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] != "serval" or len(parts) < 2 or parts[1] not in LAYERS:
                    continue
                if LAYERS.index(parts[1]) < layer_index:
                    upward.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert upward == []


def test_leaf_modules_import_no_layer():
    for leaf in ("config.py", "sampling.py", "model_source.py", "progress.py", "lifetime.py"):
        for name in _imports(ROOT / leaf):
            assert not any(name.startswith(f"serval.{layer}") for layer in LAYERS), (leaf, name)
