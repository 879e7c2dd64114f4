"""kvpush_neuron's EFA preflight for trn2 and trn3 (faked sysfs and env) and `kvpush config neuron` for a Trn3
server: the rules the vLLM Neuron plugin's tutorials set, each problem named with its fix."""

import pytest

from kvpush_neuron.efa import (PLUGIN_EFA_BDF, EfaPreflightError, TrnHost, cores_per_chip, neuron_efa_preflight,
                               neuron_transport)
from kvpush_neuron.testing.fake_host import fake_trn_host


# ---- EFA preflight --------------------------------------------------------------------------------

EFA_ENV = {"NEURON_VISIBLE_DEVICES": "32-63", "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1",
           "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


def not_trn(tmp_path):
    """A host whose DMI names no trn product: the plugin's worker pins no EFA there, nor does the preflight."""
    return TrnHost(product=tmp_path / "no-dmi")


def test_trn2_host_set_up_as_documented_passes(tmp_path):
    host, sysfs = fake_trn_host(tmp_path)
    assert neuron_efa_preflight(EFA_ENV, sysfs=sysfs, host=host, fabric_version=(2, 7)) == []
    cfg = neuron_transport({"backend_params": {"num_threads": 2}}, EFA_ENV, sysfs=sysfs, host=host,
                           fabric_version=(2, 8))
    assert cfg.backend == "LIBFABRIC" and cfg.init_params() == {"num_threads": "2"}
    assert cores_per_chip({}) == 4 and cores_per_chip({"NEURON_LOGICAL_NC_CONFIG": "1"}) == 8


def test_every_problem_is_named_with_its_fix(tmp_path):
    host, sysfs = fake_trn_host(tmp_path, efas=PLUGIN_EFA_BDF["trn2"][:4])  # launched with 4 of its 16 EFAs
    problems = neuron_efa_preflight({"NEURON_VISIBLE_DEVICES": "0-3,28", "FI_PROVIDER": "tcp",
                                     "FI_EFA_USE_DEVICE_RDMA": "0"}, sysfs=sysfs, host=host, fabric_version=(2, 1))
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert "core 28: no EFA at 0000:6d:00.0 (Neuron device 7)" in text and "all its EFA interfaces" in text
    assert "FI_PROVIDER=efa" in text and "FI_EFA_USE_DEVICE_RDMA=0 turns" in text
    assert "FI_EFA_ENABLE_SHM_TRANSFER" in text and "FABRIC_1.10" in text
    assert not any("SHM" in p for p in neuron_efa_preflight({**EFA_ENV, "FI_EFA_ENABLE_SHM_TRANSFER": "1"},
                                                          sysfs=sysfs, host=not_trn(tmp_path), same_host=False,
                                                          fabric_version=(2, 7)))
    assert "libfabric.so.1 not found" in neuron_efa_preflight(EFA_ENV, sysfs=sysfs, host=not_trn(tmp_path),
                                                              fabric_version=None)[-1]


# what the plugin's DI tutorial exports (tutorial-di-1p1d-xpyd.md): the shm transport off, nothing else of EFA;
# its worker sets NEURON_RT_MAP_HBM=1 and one NEURON_RT_VISIBLE_CORES per rank itself
TUTORIAL_ENV = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0", "FI_EFA_ENABLE_SHM_TRANSFER": "0"}


@pytest.mark.parametrize("product,chips,cores", [
    ("trn2.48xlarge", 16, "32-63"),  # the tutorial's decode, DP4 x TP8 on chips 8..15
    ("trn3.48xlarge", 16, "0-3"),  # a Trn3 Gen1 server: Trainium3 has 8 physical cores per chip too
    ("trn3.12xlarge", 4, "8-15"),  # a Trn3 Gen2 server (name assumed: any trn3* is the plugin's trn3pds): 4 chips
])
def test_the_plugin_tutorials_env_passes_on_trn2_and_trn3(tmp_path, product, chips, cores):
    family = "trn2" if product.startswith("trn2") else "trn3pds"
    host, sysfs = fake_trn_host(tmp_path, product=product, devices=chips, efas=PLUGIN_EFA_BDF[family][:chips])
    in_worker = {**TUTORIAL_ENV, "NEURON_VISIBLE_DEVICES": cores, "NEURON_RT_MAP_HBM": "1",
                 "NEURON_RT_VISIBLE_CORES": cores.split("-")[0]}  # what the connector sees inside the worker
    assert neuron_efa_preflight(in_worker, sysfs=sysfs, host=host, fabric_version=(2, 7)) == [], product
    assert neuron_efa_preflight(TUTORIAL_ENV, sysfs=sysfs, host=host, fabric_version=(2, 7)) == []  # no cores set
    neuron_transport({}, in_worker, sysfs=sysfs, host=host, fabric_version=(2, 7))
    if chips == 4:  # a Trn3 Gen2 server with one of its four EFA interfaces: chips 2 and 3 have none
        one, one_sysfs = fake_trn_host(tmp_path / "one", product=product, devices=4,
                                       efas=PLUGIN_EFA_BDF[family][:1])
        problems = neuron_efa_preflight(in_worker, sysfs=one_sysfs, host=one, fabric_version=(2, 7))
        assert [p.split(":")[0] for p in problems] == [f"core {c}" for c in range(8, 16)], problems
        assert f"no EFA at {PLUGIN_EFA_BDF[family][2]} (Neuron device 2)" in problems[0]


def test_no_efa_or_other_backends_fail_at_start_up(tmp_path):
    with pytest.raises(EfaPreflightError, match="no EFA device.*trn2.3xlarge"):
        neuron_transport({}, EFA_ENV, sysfs=tmp_path / "none", host=not_trn(tmp_path), fabric_version=(2, 7))
    with pytest.raises(EfaPreflightError, match="cannot register Neuron HBM: use LIBFABRIC"):
        neuron_transport({"backend": "ucx"}, EFA_ENV, sysfs=tmp_path / "none")


def test_config_plans_a_trn3_gen2_server(capsys):
    """A Trn3 Gen2 server has 4 Trainium3 chips (8 physical cores each, like Trainium2): 16 logical cores."""
    import json

    from kvpush_common.ops import cli

    assert cli.main(["config", "neuron", "--role", "decode", "--model", "m", "--chips", "4", "--tp", "4",
                     "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["env"]["NEURON_VISIBLE_DEVICES"] == "8-11"  # the second half of 16 cores: chip 2
    assert "Trainium chips 2 (1 EFA rails)" in plan["notes"][0]


def test_the_tutorials_two_host_environment_passes_the_default(tmp_path):
    """same_host stays true by default: the plugin's DI tutorial exports FI_EFA_ENABLE_SHM_TRANSFER=0 in every server
    terminal, on one host and in its multi-node step alike (docs/neuron.md), so a two-host pair launched from the
    tutorial's environment passes with the connector's defaults; without it only a same-host pair is refused."""
    from kvpush_common.vllm.extra_config import ExtraConfig

    tutorial = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0", "FI_EFA_ENABLE_SHM_TRANSFER": "0",
                "NEURON_VISIBLE_DEVICES": "0-3"}
    default = ExtraConfig().same_host
    host, sysfs = fake_trn_host(tmp_path)

    def shm(env, same_host):
        return [p for p in neuron_efa_preflight(env, sysfs=sysfs, host=host, same_host=same_host, fabric_version=(2, 7))
                if "FI_EFA_ENABLE_SHM_TRANSFER" in p]

    assert default is True and shm(tutorial, default) == []
    without = {k: v for k, v in tutorial.items() if k != "FI_EFA_ENABLE_SHM_TRANSFER"}
    assert shm(without, False) == [] and shm(without, default)
