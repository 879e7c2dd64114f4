"""The core's layers import only the layers below them; the core imports no device backend; backends never
import each other; no pickle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_backends_use_the_core_below_its_tooling():
    """A device backend's runtime code (everything but its `kvpush config` target) never imports ops."""
    for pkg in ("kvpush_cuda", "kvpush_neuron"):
        for py in (ROOT / pkg).rglob("*.py"):
            if py.name != "target.py":
                assert "ops" not in _core_imports(py), py


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


# kvpush_common's layers and what each may import (besides itself): protocol and transport at the bottom,
# the planner and the state machines on the protocol, endpoints on all of those, the vLLM connector on the
# endpoints; the router speaks only the protocol; ops (cli, deploy) runs the router; testing may use
# everything but ops.
LAYERS = {
    "protocol": set(),
    "transport": set(),
    "plan": {"protocol"},
    "state": {"protocol"},
    "device": {"protocol", "plan"},
    "endpoint": {"protocol", "plan", "state", "transport", "device"},
    "vllm": {"protocol", "plan", "state", "transport", "device", "endpoint"},
    "router": {"protocol"},
    "ops": {"protocol", "transport", "device", "router"},
    "testing": {"protocol", "plan", "state", "transport", "device", "endpoint", "vllm"},
}


def _core_imports(py: Path) -> set[str]:
    """The kvpush_common layers a module imports (every import in it, nested ones too)."""
    out = set()
    for node in ast.walk(ast.parse(py.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvpush_common" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_every_core_module_sits_in_a_layer_and_imports_only_layers_below():
    top = {p.name for p in (ROOT / "common").iterdir() if p.suffix == ".py" and p.name != "__init__.py"}
    assert not top, f"modules outside the layer packages: {sorted(top)}"
    assert {p.name for p in (ROOT / "common").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    for layer, allowed in LAYERS.items():
        for py in (ROOT / "common" / layer).rglob("*.py"):
            bad = _core_imports(py) - allowed - {layer}
            assert not bad, f"{py.relative_to(ROOT)} ({layer}) imports {sorted(bad)}"


def test_the_core_uses_absolute_imports_only():
    """Relative imports would hide a layer crossing from the check above."""
    for py in (ROOT / "common").rglob("*.py"):
        rel = [n.lineno for n in ast.walk(ast.parse(py.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
        assert not rel, (py, rel)
