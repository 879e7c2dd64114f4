"""The benchmarks under scripts/bench are one package: every folder a package, every module imports by package name
(never a sibling by its bare name, which works only when that file's folder is sys.path[0]), no script edits
sys.path, and none reads anything outside the repository."""

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"
MODULES = sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts)
OPTIONAL = {"matplotlib"}  # the `bench` extra: plots only


def _name(py: Path) -> str:
    parts = py.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_folder_is_a_package_and_the_layout_is_the_documented_one():
    folders = {p.parent for p in MODULES}
    assert all((f / "__init__.py").is_file() for f in folders | {ROOT / "scripts"}), folders
    assert {f.relative_to(BENCH).as_posix() for f in folders} == {".", "cpu", "gpu", "handoff", "probes"}
    assert (BENCH / "e2e.py").is_file()


def test_no_script_imports_a_sibling_by_its_bare_name_or_edits_sys_path():
    siblings = {p.stem for p in MODULES} - {"__init__"}
    for py in ROOT.joinpath("scripts").rglob("*.py"):
        tree = ast.parse(py.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & siblings, (py, node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] not in siblings, (py, node.lineno)
            elif isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                raise AssertionError(f"{py}:{node.lineno} uses sys.path")


def test_every_bench_module_imports_by_its_package_name():
    for py in MODULES:
        try:
            importlib.import_module(_name(py))
        except ModuleNotFoundError as e:  # only an optional third-party package may be missing
            assert e.name.split(".")[0] in OPTIONAL, (py, e)


def test_nothing_outside_the_repository_is_named():
    for py in BENCH.rglob("*"):
        if py.is_file() and py.suffix in (".py", ".sh"):
            assert "../shared" not in py.read_text(), py
