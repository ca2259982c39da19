"""The layers call downwards only: api -> serving -> engine -> runner. An upward import fails this test."""

from __future__ import annotations

from tests.imports import ROOT, imported_names, modules

LAYERS = ["api", "serving", "engine", "runner"]


def _imports(path) -> list[str]:
    return imported_names(path)


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


def test_only_the_entry_points_import_the_entry_points():
    """serval/entrypoints/ sits above every layer (the CLI, the terminal tools, the offline LLM): nothing below
    it imports it. serval/__init__.py (the lazy `LLM`) and serval/cli.py (`python -m serval.cli`) point in."""
    upward = []
    for name, path in modules().items():
        if name.startswith("serval.entrypoints") or name in ("serval", "serval.cli"):
            continue
        upward += [f"{name} imports {i}" for i in _imports(path) if i.startswith("serval.entrypoints")]
    assert upward == []
