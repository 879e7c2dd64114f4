"""The core imports no device backend; backends never import each other."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(pkg_dir: Path) -> set[str]:
    names = set()
    for py in pkg_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_core_imports_no_backend():
    assert not _imports(ROOT / "common") & {"kvpush_cuda", "kvpush_neuron"}


def test_only_the_vllm_connector_imports_vllm_or_torch():
    for py in (ROOT / "common").rglob("*.py"):
        if (ROOT / "common" / "vllm") in py.parents:
            continue
        tree = ast.parse(py.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        assert not mods & {"vllm", "torch"}, py


def test_backends_do_not_import_each_other():
    assert "kvpush_neuron" not in _imports(ROOT / "kvpush_cuda")
    assert "kvpush_cuda" not in _imports(ROOT / "kvpush_neuron")


def test_no_pickle_anywhere():
    for pkg in ("common", "kvpush_cuda", "kvpush_neuron"):
        used = _imports(ROOT / pkg)
        assert not used & {"pickle", "cloudpickle", "dill"}, pkg
        for py in (ROOT / pkg).rglob("*.py"):
            text = py.read_text()
            for call in (".get_serialized_descs(", ".deserialize_descs(", ".recv_pyobj(", ".send_pyobj("):
                assert call not in text, (py, call)
