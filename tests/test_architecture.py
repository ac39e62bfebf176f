"""The library's house rules, read from the source: no import loops, imports that point down the
layers docs/architecture.md states, no by-name loading outside the CLI, short modules, and the
outer layers (components/, pipelines/) using the library through `bert_core.cli` only."""

from __future__ import annotations

import ast
import re

import pytest

from tests.import_graph import (
    PKG,
    ROOT,
    against_layers,
    all_modules,
    cycles,
    doc_layers,
    graph,
    imports_of,
    module_path,
    unit_of,
)

MAX_LINES = 400


def test_no_import_loops():
    assert cycles(graph()) == []


def test_the_loop_finder_finds_loops():
    """The checks above and below can fail: a loop and an upward import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    layers = [["bert_core.serve"], ["bert_core.finetune"]]
    wrong = against_layers({"bert_core.finetune.engine": {"bert_core.serve.registry"}}, layers)
    assert wrong == [
        "bert_core.finetune.engine -> bert_core.serve.registry (finetune may not import serve)"
    ]
    siblings = [["bert_core.serve", "bert_core.report"]]
    assert against_layers({"bert_core.report.evaluate": {"bert_core.serve.predict"}}, siblings)


def test_imports_point_down_the_layers_of_the_architecture_doc():
    layers = doc_layers()
    units = [u for layer in layers for u in layer]
    for unit in units:  # the doc names only real packages and modules
        assert module_path(unit), f"docs/architecture.md names {unit}, which does not exist"
    for module in all_modules():  # and every module is in a layer
        unit_of(module, units)
    assert against_layers(graph(), layers) == []


def test_every_package_is_a_layer_of_its_own_or_a_unit_in_one():
    """The folder listing is the architecture: each sub-package of bert_core is a unit."""
    units = {u for layer in doc_layers() for u in layer}
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PKG.glob("*/__init__.py")}
    assert packages <= units


def test_only_the_cli_loads_modules_by_name():
    """Registries are tables of imported objects (`finetune.command.TASKS`,
    `serve.predictors.PREDICTORS`), so readers and the import checks see every edge; the CLI's
    dispatch table stays lazy (start-up time: `bert clean` never imports torch's users)."""
    by_name = re.compile(r"\bimport_module\(|\b__import__\(|importlib\.util")
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in PKG.rglob("*.py")
        if by_name.search(p.read_text()) and p.name != "cli.py"
    ]
    assert offenders == []
    from bert_core.cli import COMMANDS

    for module, _ in COMMANDS.values():  # and its table names real modules with a main
        tree = ast.parse(module_path(module).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), module


def test_no_module_is_over_400_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_formatter_owns_the_layout():
    """No Python file of ours takes its layout back from `ruff format` (`make lint` checks the
    rest: every file formatted)."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b")
    ours = [
        p
        for d in ("bert_core", "components", "pipelines", "tests", "bench", "docs")
        for p in (ROOT / d).rglob("*.py")
    ]
    assert [p.relative_to(ROOT).as_posix() for p in ours if marker.search(p.read_text())] == []


def test_each_package_says_what_it_owns_and_may_import():
    for init in sorted(PKG.glob("**/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 20, f"{init}: say what the package owns"
        if init.parent != PKG:
            assert "May import" in doc, f"{init}: say what it may import"


@pytest.mark.parametrize("folder", ["components", "pipelines"])
def test_the_outer_layers_use_the_library_through_the_cli_only(folder):
    """docs/architecture.md: the Kubeflow components and the pipelines (KFP, the DVC runner,
    the pod harness) import `bert_core.cli` and nothing else of bert_core, anywhere in a file."""
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    used = {f.name: imports_of(f) for f in files}
    assert {name: mods - {"bert_core.cli"} for name, mods in used.items()} == {
        f.name: set() for f in files
    }
    assert any("bert_core.cli" in mods for mods in used.values())  # they do use it
