"""`kvpush doctor --target neuron` maps each visible core to its EFA as the vLLM Neuron plugin's worker does (its PCI
table per instance family, docs/neuron.md fact 30) and names the start-up error the plugin would raise instead
(faked DMI product name, /dev/neuron* and PCI sysfs)."""

from pathlib import Path

from kvpush_neuron.target import PLUGIN_EFA_BDF, efa_affinity_check, neuron_checks, plugin_instance_family


def fake_host(tmp, product="trn2.48xlarge", devices=16, efas=None, minors=None):
    """A host whose /dev/neuron<i> has minor minors[i] (default i) and whose EFAs sit at the given BDFs."""
    (tmp / "dmi").mkdir(parents=True)
    (tmp / "dmi" / "product_name").write_text(product + "\n")
    dev = tmp / "dev"
    dev.mkdir()
    for i in range(devices):
        (dev / f"neuron{i}").touch()
    family = plugin_instance_family({}, product)
    for n, bdf in enumerate(efas if efas is not None else PLUGIN_EFA_BDF.get(family, ())):
        (tmp / "pci" / bdf / "infiniband" / f"rdmap{n:03d}s0").mkdir(parents=True)
    minors = minors or {}
    return dict(product=tmp / "dmi" / "product_name", dev=dev, pci=tmp / "pci",
                minor=lambda p: minors.get(int(Path(p).name[6:]), int(Path(p).name[6:])))


def test_the_plugins_family_rule():
    assert plugin_instance_family({}, "trn2.48xlarge") == "trn2"
    assert plugin_instance_family({}, "trn3.48xlarge") == "trn3pds"  # any trn3 takes the pds table
    assert plugin_instance_family({"VLLM_NEURON_EFA_INSTANCE_FAMILY": "trn3pd"}, "trn3.48xlarge") == "trn3pd"
    assert plugin_instance_family({}, None) is None


def test_each_core_gets_the_efa_at_its_devices_pci_address(tmp_path):
    # device 0's EFA is 0000:c9:00.0 in the plugin's trn2 table, which sorts after others in sysfs
    host = fake_host(tmp_path)
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0-3,4,60-63"}, **host)
    assert check.ok, check
    # cores 0-3 are device 0 (LNC=2: 4 logical cores per 8-core chip), core 4 device 1, cores 60-63 device 15
    assert check.detail == "trn2: cores:EFA 0-3:rdmap000s0 4:rdmap001s0 60-63:rdmap015s0"
    # the host device is /dev/neuron<n>'s minor, as the plugin reads it: a remapped device takes its own EFA
    remapped = fake_host(tmp_path / "remapped", minors={0: 5})
    assert efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, **remapped).detail.endswith(" 0:rdmap005s0")


def test_a_missing_efa_is_the_plugins_start_up_error_with_its_fix(tmp_path):
    host = fake_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][:8])  # launched with 8 of its 16 EFA interfaces
    check = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "28-35"}, **host)
    assert not check.ok and not check.warn
    assert len(check.problems) == 4 and all("no EFA at 0000:98:00.0 (Neuron device 8)" in p for p in check.problems)
    assert "NEURON_SKIP_EFA_AFFINITY=1" in check.problems[0]
    assert efa_affinity_check({"NEURON_VISIBLE_DEVICES": "28-35", "NEURON_SKIP_EFA_AFFINITY": "1"}, **host).ok
    gone = fake_host(tmp_path / "two", devices=2)
    assert "neuron15 is missing" in efa_affinity_check({"NEURON_VISIBLE_DEVICES": "60"}, **gone).problems[0]


def test_an_unknown_family_fails_on_a_trn_host_and_is_not_checked_elsewhere(tmp_path):
    trn1 = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, **fake_host(tmp_path, product="trn1.32xlarge"))
    assert not trn1.ok and not trn1.warn and "'trn1'" in trn1.problems[0]
    other = efa_affinity_check({"NEURON_VISIBLE_DEVICES": "0"}, **fake_host(tmp_path / "x", product="m7i.large"))
    assert other.ok and "not a trn host" in other.detail and "not checked" in other.detail


def test_the_doctor_runs_it(monkeypatch):
    from kvpush_common.ops import doctor

    monkeypatch.setattr(doctor, "check_nixl", lambda env, backends, **kw: [])  # its plugin test-load has its own test
    monkeypatch.setattr(doctor, "check_fabric", lambda env, hmem_for, probe=None: doctor.Check("fabric", True))
    names = [c.name for c in neuron_checks({"NEURON_VISIBLE_DEVICES": "0-3"}, None, fabric_version=(2, 7),
                                           fabric_symbol=None)]
    assert "efa-affinity" in names
