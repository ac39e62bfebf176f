"""The import graph of `bert_core`, read from the source (ast): what tests/test_architecture.py
holds to docs/architecture.md's layers and tests/pipelines/test_pipeline_dvc.py turns into DVC deps.

Every import counts, wherever it is: at the top, inside a function (a lazy import runs when the
function does) or under `TYPE_CHECKING` (a loop hidden there is still a loop for a reader).
`from bert_core.pkg import name` is an import of the module `bert_core.pkg.name` when there is
one, else of `bert_core.pkg` (a name defined in its `__init__.py`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "bert_core"


def module_path(name: str) -> Path | None:
    """The file of a bert_core module or package (`bert_core.model` -> model/__init__.py)."""
    parts = name.split(".")
    base = ROOT.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def all_modules() -> list[str]:
    """Every module and package of bert_core, as dotted names."""
    names = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _resolve(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == "bert_core"}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module.split(".")[0] != "bert_core":
            return set()
        found = set()
        for alias in node.names:
            sub = f"{node.module}.{alias.name}"
            found.add(sub if module_path(sub) else node.module)
        return found
    if isinstance(node, ast.ImportFrom) and node.level:
        raise AssertionError("relative import: bert_core imports are absolute")
    return set()


def imports_of(path: Path, entry_only: bool = False) -> set[str]:
    """The bert_core modules a file imports; with `entry_only` only those at module level and in
    `main` (what `bert <command>` runs of bert_core.cli, whose other functions are the KFP and
    DVC helpers)."""
    tree = ast.parse(path.read_text())
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    tops = [n for n in tree.body if not (entry_only and isinstance(n, scopes) and n.name != "main")]
    return {m for top in tops for node in ast.walk(top) for m in _resolve(node)}


def graph() -> dict[str, set[str]]:
    """module -> the bert_core modules it imports (itself left out)."""
    return {m: imports_of(module_path(m)) - {m} for m in all_modules()}


def parents(name: str) -> list[str]:
    """The packages whose `__init__.py` importing `name` runs: bert_core.a.b -> bert_core,
    bert_core.a."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def cycles(edges: dict[str, Iterable[str]]) -> list[list[str]]:
    """The import loops: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def doc_layers(doc: Path = ROOT / "docs" / "architecture.md") -> list[list[str]]:
    """The layers docs/architecture.md states, top first: the lines of its ```layers block,
    each a list of units (a package or module under bert_core, `.` for bert_core itself)."""
    block = re.search(r"```layers\n(.*?)```", doc.read_text(), re.S)
    assert block, f"{doc}: no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        units = line.split("#")[0].split()
        if units:
            layers.append(["bert_core" if u == "." else f"bert_core.{u}" for u in units])
    return layers


def unit_of(module: str, units: Iterable[str]) -> str:
    """The unit a module belongs to: the longest unit that is it or one of its parents."""
    matches = [u for u in units if module == u or module.startswith(u + ".")]
    assert matches, f"{module}: in no layer of docs/architecture.md"
    return max(matches, key=len)


def against_layers(edges: dict[str, Iterable[str]], layers: list[list[str]]) -> list[str]:
    """Every import that does not point down: a module may import its own unit and the units
    of lower layers, never a unit of its own layer (siblings stay independent) or above."""
    rank = {u: len(layers) - i for i, layer in enumerate(layers) for u in layer}
    wrong = []
    for src, targets in edges.items():
        a = unit_of(src, rank)
        for dst in targets:
            b = unit_of(dst, rank)
            if a != b and rank[b] >= rank[a]:
                wrong.append(
                    f"{src} -> {dst} ({a.removeprefix('bert_core.')} may not import "
                    f"{b.removeprefix('bert_core.')})"
                )
    return sorted(wrong)
