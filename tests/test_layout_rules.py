"""The repository's layout rules (docs/design.md, "Layout"), checked on the source: imports run downward only, no
module reads another class's private attributes, engine/ keeps its rooms, and source files carry no dated lab notes."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("offload_engine", "cpu_attention", "gpu_kernels")
DATE = re.compile(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.append(node.module)
    return modules


def test_no_package_of_ours_takes_an_installed_distributions_import_name():
    """Two packages of one import name shadow each other: transformers 5.25 installs Hugging Face's `kernels`, and our
    device kernels, once named so, broke every model build."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    taken = {name: owners[name] for name in PACKAGES
             if set(owners.get(name, ())) - {"offload-engine", "offload_engine"}}
    assert not taken


def test_layers_import_nothing_from_engine():
    upward = [(p.name, m) for p in _sources("offload_engine/layers") for m in _imported_modules(p)
              if m.startswith("offload_engine.engine")]
    assert not upward


def test_the_packages_import_nothing_from_benchmarks():
    upward = [(str(p.relative_to(ROOT)), m) for p in _sources(*PACKAGES) for m in _imported_modules(p)
              if m == "benchmarks" or m.startswith("benchmarks.")]
    assert not upward


def _private_attributes_by_class(paths: list[Path]) -> dict[str, set[str]]:
    """Private methods and `self._x` attributes of every class in these files: name -> the classes that own it."""
    owners: dict[str, set[str]] = {}
    for path in paths:
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef):
                    name = node.name
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    name = node.attr
                else:
                    continue
                if name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(cls.name)
    return owners


def test_no_module_reads_another_class_private_attributes():
    owners = _private_attributes_by_class(_sources(*PACKAGES))
    reach_ins = []
    for path in _sources(*PACKAGES, "benchmarks"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in owners:
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls", *owners[node.attr]):
                reach_ins.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not reach_ins


def test_engine_keeps_at_most_eight_modules_at_its_top():
    assert len(list((ROOT / "offload_engine/engine").glob("*.py"))) <= 8


@pytest.mark.parametrize("package, limit", [("offload_engine", 10), ("cpu_attention", 25), ("gpu_kernels", 25)])
def test_module_docstrings_are_short_and_no_source_file_carries_a_date(package, limit):
    long_openings, dated = [], []
    for path in _sources(package):
        text = path.read_text()
        if DATE.search(text):
            dated.append(str(path.relative_to(ROOT)))
        tree = ast.parse(text)
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
        if doc is not None and isinstance(doc.value, ast.Constant) and doc.end_lineno - doc.lineno + 1 > limit:
            long_openings.append(f"{path.relative_to(ROOT)} ({doc.end_lineno - doc.lineno + 1} lines)")
    assert not dated, "dated measurements belong in docs/decisions/"
    assert not long_openings
