"""Product folders hold the product (issue #42): every module under `pipelines/` is a command
(`python -m pipelines.X` or `pipelines/X.py`, a `__main__` block) or is imported by product code
(pipelines/, components/, bert_core/), directly or through another product module. What only
tests use, such as the model of the Kubeflow backend (tests/cluster/), lives under tests/.

Imports are read from the source (ast), wherever they are: at the top or inside a function (a
lazy import runs when its function does)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("pipelines", "components", "bert_core")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(*folders: str) -> dict[str, Path]:
    return {_name(p): p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules among `known` that `path` imports (`from a import b` counts `a.b` when that
    is a module, else `a`; relative imports resolved against the file's package)."""
    package = _name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[: len(package) - node.level + 1]
                base = ".".join([*prefix, *([base] if base else [])])
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def _is_command(path: Path) -> bool:
    """A module with a `if __name__ == "__main__":` block."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = {getattr(n, "id", None) for n in [node.test.left, *node.test.comparators]}
            values = {getattr(n, "value", None) for n in node.test.comparators}
            if "__name__" in names and "__main__" in values:
                return True
    return False


def _product_reach() -> set[str]:
    """The product modules reachable from the commands under pipelines/ and from every module of
    components/ and bert_core/ (the KFP components and the library)."""
    product = _modules(*PRODUCT)
    known = set(product)
    todo = [n for n, p in product.items() if not n.startswith("pipelines") or _is_command(p)]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += _imports(product[name], known)
    return reached


def test_every_pipelines_module_is_a_command_or_imported_by_product_code():
    reached = _product_reach()
    pipelines = [n for n in _modules("pipelines") if n != "pipelines"]
    tests = _modules("tests")
    orphans = {}
    for name in pipelines:
        if name not in reached:
            users = sorted(
                str(p.relative_to(ROOT)) for p in tests.values() if name in _imports(p, {name})
            )
            orphans[name] = users
    assert not orphans, (
        "modules under pipelines/ that no product code imports and that are no command (move "
        f"them under tests/): {orphans}"
    )


def test_the_scan_sees_lazy_imports_and_the_tests_model_of_the_backend():
    """The scan would pass vacuously if it missed imports: the spec check's module is reached
    only through a function-level import (bert_pipeline.check_spec), and the backend model's
    modules are imported by tests alone."""
    reached = _product_reach()
    assert {"pipelines.bert_pipeline", "pipelines.kfp_backend", "pipelines.cluster"} <= reached
    harness = ROOT / "tests" / "cluster" / "pod_harness.py"
    model = {"tests.cluster.kfp_cel", "tests.cluster.pod_env", "pipelines.kfp_backend"}
    assert _imports(harness, model | {"tests.cluster"}) == model
    assert not any(n.startswith("tests") for n in reached)
