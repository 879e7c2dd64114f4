"""kvpush_cuda's NIXL backend choice and EFA preflight (no EFA here: sysfs and libfabric are faked)."""

import os

import pytest

from kvpush_cuda.efa import EfaPreflightError, choose_transport, efa_devices, efa_preflight

GOOD_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}


def fake_sysfs(tmp_path, names, driver="efa"):
    root = tmp_path / "infiniband"
    drivers = tmp_path / "drivers" / driver
    drivers.mkdir(parents=True)
    for n in names:
        (root / n / "device").mkdir(parents=True)
        os.symlink(drivers, root / n / "device" / "driver")
    return root


def test_no_efa_host_defaults_to_ucx(tmp_path):
    cfg = choose_transport({}, {}, sysfs=tmp_path / "none")
    assert cfg.backend == "UCX" and not cfg.progress_thread_for("producer")


def test_efa_host_defaults_to_libfabric_after_a_clean_preflight(tmp_path):
    sysfs = fake_sysfs(tmp_path, [f"rdmap{i}s0" for i in range(16)])
    assert len(efa_devices(sysfs)) == 16
    cfg = choose_transport({"backend_params": {"num_threads": 4}}, GOOD_ENV, sysfs=sysfs, gpus=8,
                           fabric_version=(2, 7))
    assert cfg.backend == "LIBFABRIC" and cfg.init_params() == {"num_threads": "4"}
    assert cfg.progress_thread_for("consumer") and not cfg.progress_thread_for("producer")


def test_every_problem_is_named_with_its_fix(tmp_path):
    sysfs = fake_sysfs(tmp_path, ["rdmap0s0"])
    problems = efa_preflight({"FI_PROVIDER": "tcp"}, sysfs=sysfs, gpus=8, fabric_version=(2, 1))
    text = "\n".join(problems)
    assert len(problems) == 4
    assert "1 EFA rails for 8 GPUs" in text and "FI_PROVIDER=efa" in text
    assert "FI_EFA_USE_DEVICE_RDMA" in text and "FABRIC_1.10" in text
    assert "libfabric.so.1 not found" in efa_preflight(GOOD_ENV, sysfs=sysfs, fabric_version=None)[0]


def test_libfabric_requested_on_a_host_without_efa_fails_at_start_up(tmp_path):
    with pytest.raises(EfaPreflightError, match="no EFA device"):
        choose_transport({"backend": "LIBFABRIC"}, GOOD_ENV, sysfs=tmp_path / "none", fabric_version=(2, 7))
    with pytest.raises(EfaPreflightError, match="unknown NIXL backend"):
        choose_transport({"backend": "verbs"}, {}, sysfs=tmp_path / "none")


def test_libfabric_version_reads_fi_version():
    from kvpush_common.transport.efa import libfabric_version

    class Lib:
        class fi_version:  # noqa: N801 - mimics the ctypes function attribute
            restype = None

            def __new__(cls):
                return (2 << 16) | 7

    def missing(name):
        raise OSError(name)

    assert libfabric_version(lambda name: Lib) == (2, 7)
    assert libfabric_version(missing) is None
