"""Each visible core's EFA as the vLLM Neuron plugin's worker maps it (its PCI table per instance family,
docs/neuron.md fact 30), read by one function (`efa.plugin_rails`) for both the connector's start-up preflight and
`kvpush doctor --target neuron`, with the start-up error the plugin would raise instead (faked DMI product name,
/dev/neuron* and PCI sysfs)."""

import os

import pytest

from types import SimpleNamespace

from kvpush_neuron import efa
from kvpush_neuron.efa import (PLUGIN_EFA_BDF, EfaPreflightError, efa_devices, neuron_efa_preflight,
                               neuron_transport, plugin_instance_family, plugin_pins_efa, plugin_rails)
from kvpush_neuron.testing.fake_host import SIM_HOST_ENV, fake_trn_host, trn_host_at
from kvpush_neuron.target import efa_affinity_check, neuron_checks

READY = {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}  # the plugin's DI tutorial's environment


def test_the_plugins_family_rule():
    assert plugin_instance_family({}, "trn2.48xlarge") == "trn2"
    assert plugin_instance_family({}, "trn3.48xlarge") == "trn3pds"  # any trn3 takes the pds table
    assert plugin_instance_family({"VLLM_NEURON_EFA_INSTANCE_FAMILY": "trn3pd"}, "trn3.48xlarge") == "trn3pd"
    assert plugin_instance_family({}, None) is None


def test_each_core_gets_the_efa_at_its_devices_pci_address(tmp_path):
    # device 0's EFA is 0000:c9:00.0 in the plugin's trn2 table (rdmap201s0), which sorts after others in sysfs
    host, sysfs = fake_trn_host(tmp_path)
    assert efa_devices(sysfs)[0] == "rdmap086s0"  # sysfs order is not the chips' order
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0-3,4,60-63"}, host)
    assert check.ok, check
    # cores 0-3 are device 0 (LNC=2: 4 logical cores per 8-core chip), core 4 device 1, cores 60-63 device 15
    assert check.detail == "trn2: cores:EFA 0-3:rdmap201s0 4:rdmap180s0 60-63:rdmap246s0"
    # the host device is /dev/neuron<n>'s minor, as the plugin reads it: a remapped device takes its own EFA
    remapped, _ = fake_trn_host(tmp_path / "remapped", minors={0: 5})
    assert efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, remapped).detail.endswith(" 0:rdmap087s0")
    lnc1 = plugin_rails({"NEURON_VISIBLE_DEVICES": "8", "NEURON_LOGICAL_NC_CONFIG": "1"}, host)
    assert lnc1.rails == [(8, "rdmap180s0")]  # LNC=1: 8 logical cores per chip, core 8 on device 1


def test_a_missing_efa_is_the_plugins_start_up_error_with_its_fix(tmp_path):
    host, _ = fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][:8])  # launched with 8 of its 16 EFA interfaces
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "28-35"}, host)
    assert not check.ok and not check.warn
    assert len(check.problems) == 4 and all("no EFA at 0000:98:00.0 (Neuron device 8)" in p for p in check.problems)
    assert "NEURON_SKIP_EFA_AFFINITY=1" in check.problems[0]
    assert efa_affinity_check({"NEURON_VISIBLE_DEVICES": "28-35", "NEURON_SKIP_EFA_AFFINITY": "1"}, host).ok
    gone, _ = fake_trn_host(tmp_path / "two", devices=2)
    assert "neuron15 is missing" in efa_affinity_check({"NEURON_VISIBLE_DEVICES": "60"}, gone).problems[0]


def test_an_unknown_family_fails_on_a_trn_host_and_is_not_checked_elsewhere(tmp_path):
    trn1, _ = fake_trn_host(tmp_path, product="trn1.32xlarge")
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, trn1)
    assert not check.ok and not check.warn and "'trn1'" in check.problems[0]
    other, _ = fake_trn_host(tmp_path / "x", product="m7i.large")
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, other)
    assert check.ok and "not a trn host" in check.detail and "not checked" in check.detail


def test_the_connectors_preflight_takes_each_ranks_rail_from_the_plugins_table(tmp_path):
    """A trn2 host launched with the 8 EFAs of chips 8..15 only: 8 EFA devices in sysfs, so a rail count in sysfs
    order gives chip 0 one, while the plugin's table (and libnrt) put chip 0's at 0000:c9:00.0, which is absent:
    the connector refuses at start-up as the plugin's worker would, naming the address and the fix."""
    host, sysfs = fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][8:])
    env = {**READY, "NEURON_VISIBLE_DEVICES": "0-3"}
    assert len(efa_devices(sysfs)) == 8
    problems = neuron_efa_preflight(env, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7")
    assert len(problems) == 4 and all("no EFA at 0000:c9:00.0 (Neuron device 0)" in p for p in problems), problems
    with pytest.raises(EfaPreflightError, match="no EFA at 0000:c9:00.0.*NEURON_SKIP_EFA_AFFINITY=1"):
        neuron_transport({}, env, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7")
    # chips 8..15 have theirs: the decode of the plugin's tutorial (DP4 x TP8 on cores 32-63) starts
    decode = {**READY, "NEURON_VISIBLE_DEVICES": "32-63"}
    assert neuron_efa_preflight(decode, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7") == []
    # the doctor reports the same rails from the same function, once (under efa-affinity, not again under efa)
    assert list(efa_affinity_check(env, host).problems) == plugin_rails(env, host).problems == problems
    assert neuron_efa_preflight(env, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7",
                                rails=False) == []


@pytest.mark.parametrize("product,chips,cores", [
    ("trn2.48xlarge", 16, "32-63"),
    ("trn3.48xlarge", 16, "0-3"),  # the plugin maps any trn3* product name to its trn3pds table
])
def test_a_fully_launched_host_passes_the_preflight(tmp_path, product, chips, cores):
    host, sysfs = fake_trn_host(tmp_path, product=product, devices=chips)
    env = {**READY, "NEURON_VISIBLE_DEVICES": cores}
    assert neuron_efa_preflight(env, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7") == []
    first, last = map(int, cores.split("-"))
    rails = plugin_rails(env, host)
    assert rails.checked and [c for c, _ in rails.rails] == list(range(first, last + 1))


def test_the_doctor_runs_it(monkeypatch):
    from kvpush_common.ops import doctor

    monkeypatch.setattr(doctor, "check_nixl", lambda env, backends, **kw: [])  # its plugin test-load has its own test
    monkeypatch.setattr(doctor, "check_fabric", lambda env, hmem_for, probe=None: doctor.Check("fabric", True))
    names = [c.name for c in neuron_checks({"NEURON_VISIBLE_DEVICES": "0-3"}, None, fabric_version=(2, 7),
                                           fabric_symbol=None)]
    assert "efa-affinity" in names


@pytest.mark.parametrize("value,pins", [(None, True), ("0", True), ("1", False), ("true", False), ("", False)])
def test_the_skip_switch_is_read_as_the_plugins_worker_reads_it(tmp_path, value, pins):
    """The plugin's worker pins (and raises on a missing EFA) only where NEURON_SKIP_EFA_AFFINITY is unset or "0"
    (neuron_worker.py @ 03bd80a2): "true" or an empty value skip it there, so kvpush checks no rail either; "0"
    checks them.  Reading only "1" as skip refused hosts the plugin serves."""
    host, sysfs = fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][8:])  # chip 0's EFA absent
    env = {**READY, "NEURON_VISIBLE_DEVICES": "0"} | ({} if value is None else {"NEURON_SKIP_EFA_AFFINITY": value})
    assert plugin_pins_efa(env) is pins
    rails = plugin_rails(env, host)
    assert rails.checked is pins and bool(rails.problems) is pins
    if not pins:
        assert f"NEURON_SKIP_EFA_AFFINITY={value!r}" in rails.summary() and "pins no EFA" in rails.summary()
    problems = neuron_efa_preflight(env, sysfs=sysfs, host=host, fabric_version=(2, 4), fabric_symbol="FABRIC_1.7")
    assert bool(problems) is pins and all("no EFA at 0000:c9:00.0" in p for p in problems)


def test_a_faked_host_reads_back_in_another_process(tmp_path):
    made, sysfs = fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][8:], minors={0: 9})
    host, again = trn_host_at(tmp_path)
    env = {"NEURON_VISIBLE_DEVICES": "0,32"}
    assert again == sysfs and plugin_rails(env, host).rails == plugin_rails(env, made).rails == [
        (0, "rdmap131s0"), (32, "rdmap152s0")]  # /dev/neuron0's minor 9: 0000:83:00.0, device 8: 0000:98:00.0
    with pytest.raises(FileNotFoundError, match="no faked trn host"):
        trn_host_at(tmp_path / "nothing")


@pytest.fixture
def simulated(monkeypatch):
    from kvpush_neuron.testing.simulated_plugin import SimulatedNeuronPluginConnector

    monkeypatch.setattr(efa, "libfabric_version", lambda: (2, 4))  # the SDK's EFA installer's line, nixl 1.3.2's
    monkeypatch.setattr(efa, "nixl_fabric_symbol", lambda: "FABRIC_1.7")
    for name in ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NEURON_SKIP_EFA_AFFINITY", "NEURON_LOGICAL_NC_CONFIG",
                 "VLLM_NEURON_EFA_INSTANCE_FAMILY", SIM_HOST_ENV, "NEURON_VISIBLE_DEVICES"):
        monkeypatch.setenv(name, "x")  # recorded, so that what a test or the connector writes is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("FI_EFA_ENABLE_SHM_TRANSFER", "0")
    monkeypatch.setenv("FI_PROVIDER", "tcp")  # the LIBFABRIC tier's provider, standing for efa
    conn = object.__new__(SimulatedNeuronPluginConnector)
    conn._vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=4,
                                                                        pipeline_parallel_size=1))
    return conn


def test_the_simulated_plugin_runs_the_connectors_preflight_on_a_faked_host(tmp_path, monkeypatch, simulated):
    """The simulated plugin's vLLM servers map their cores to rails through the plugin's table on a faked trn2
    (the scenarios under tests/libfabric run it end to end): a core whose chip's EFA is absent is refused at
    start-up, the plugin's own defaults and switch apply; before, the simulation skipped the preflight."""
    with pytest.raises(ValueError, match=SIM_HOST_ENV):
        simulated.choose_transport({"backend": "LIBFABRIC"})
    fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][8:])  # launched with the EFAs of chips 8..15 only
    monkeypatch.setenv(SIM_HOST_ENV, str(tmp_path))
    # NEURON_VISIBLE_DEVICES unset: the plugin's worker takes cores 0..TP-1, chip 0, whose EFA is absent
    with pytest.raises(EfaPreflightError, match=r"no EFA at 0000:c9:00\.0 \(Neuron device 0\)"):
        simulated.choose_transport({"backend": "LIBFABRIC"})
    assert os.environ["NEURON_VISIBLE_DEVICES"] == "0,1,2,3"
    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "32-35")  # chip 8's cores
    transport = simulated.choose_transport({"backend": "LIBFABRIC", "backend_params": {"num_threads": 2}})
    assert transport.backend == "LIBFABRIC" and transport.backend_params == {"num_threads": "2"}
    with pytest.raises(EfaPreflightError, match="NIXL backend 'UCX' cannot register Neuron HBM"):
        simulated.choose_transport({"backend": "UCX"})
    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("NEURON_SKIP_EFA_AFFINITY", "1")  # the plugin pins nothing, and kvpush checks no rail
    assert simulated.choose_transport({"backend": "LIBFABRIC"}).backend == "LIBFABRIC"
    monkeypatch.setenv("NEURON_SKIP_EFA_AFFINITY", "0")
    monkeypatch.setenv("NEURON_VISIBLE_DEVICES", "32")
    monkeypatch.setenv("FI_EFA_ENABLE_SHM_TRANSFER", "1")  # the environment's rules run too
    with pytest.raises(EfaPreflightError, match="FI_EFA_ENABLE_SHM_TRANSFER is not 0"):
        simulated.choose_transport({"backend": "LIBFABRIC"})
    monkeypatch.setenv("FI_EFA_ENABLE_SHM_TRANSFER", "0")
    monkeypatch.setenv("FI_PROVIDER", "verbs")  # only tcp stands for efa
    with pytest.raises(EfaPreflightError, match="FI_PROVIDER=verbs"):
        simulated.choose_transport({"backend": "LIBFABRIC"})


def test_a_libfabric_between_releases_passes_where_it_defines_what_nixl_needs(tmp_path, monkeypatch):
    """libfabric main after 2.6 (the LIBFABRIC tier's vendored 2.7.0a1) reports 2.6 and defines FABRIC_1.10, which
    NIXL 1.5.1's plugin loads: the probed preflight reads the loaded file's version nodes, not only its number
    (the simulated plugin's vLLM servers were refused on that library before)."""
    lib = tmp_path / "libfabric.so.1.32.0"
    lib.write_bytes(b"\x7fELF...FABRIC_1.0\x00FABRIC_1.9\x00FABRIC_1.10\x00fi_getinfo\x00")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f10 r-xp 00000000 08:01 42 {lib}\n7f20-7f30 r-xp 00000000 08:01 43 /usr/lib/libc.so.6\n")
    assert efa.loaded_fabric_symbol(load=lambda name: None, maps=maps) == "FABRIC_1.10"
    monkeypatch.setattr(efa, "libfabric_version", lambda: (2, 6))
    monkeypatch.setattr(efa, "nixl_fabric_symbol", lambda: "FABRIC_1.10")
    monkeypatch.setattr(efa, "loaded_fabric_symbol", lambda: "FABRIC_1.10")
    assert efa.fabric_env_problems({}) == []
    monkeypatch.setattr(efa, "loaded_fabric_symbol", lambda: "FABRIC_1.9")  # a real 2.6.0 release
    assert "libfabric 2.6 lacks the FABRIC_1.10 symbols" in efa.fabric_env_problems({})[0]
    # given a version (the doctor's stock-host tests), the number alone decides, as before
    monkeypatch.setattr(efa, "loaded_fabric_symbol", lambda: "FABRIC_1.10")
    assert efa.fabric_env_problems({}, (2, 6), "FABRIC_1.10")
