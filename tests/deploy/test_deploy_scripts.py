"""scripts/deploy/run.sh (--target neuron|cuda, --layout 1p1d-same-host|1p1d-two-host|xpyd) with --dry-run: every
server with its generated environment and device split, kvpush doctor before each, the router, the health waits,
the 20-point `vllm bench serve` sweep writing JSON into the results directory, --install, and nothing written."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "scripts" / "deploy" / "run.sh"
KVPUSH = Path(sys.executable).parent / "kvpush"
TWO_HOSTS = ["--prefill-host", "10.9.0.1", "--decode-host", "10.9.0.2"]


def dry_run(target: str, layout: str, *args: str, tmp_path: Path) -> str:
    results = tmp_path / "results"
    out = subprocess.run(["bash", str(RUN), "--target", target, "--layout", layout, "--dry-run", "--results", str(results),
                          *args],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "KVPUSH": str(KVPUSH)})
    assert out.returncode == 0, out.stderr
    assert not results.exists() and list(tmp_path.iterdir()) == []  # a dry run writes nothing
    return out.stdout


def servers(out: str) -> dict[str, dict]:
    """name -> {host, env, argv text, commands run for it} from the printed server sections."""
    found = {}
    for block in re.split(r"^# ---- ", out, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        name, _, host = head.split(" (")[0].partition(" on ")
        env = dict(re.findall(r"^export (\w+)=(\S+)$", body, flags=re.M))
        cmds = [line[2:] for line in body.splitlines() if line.startswith("+ ")]
        found[name] = {"host": host, "env": env, "body": body, "cmds": cmds}
    return found


def bench_points(out: str, results: Path) -> set[tuple[int, int]]:
    points = set()
    for line in out.splitlines():
        if " bench serve " not in line:
            continue
        argv = shlex.split(line[2:])
        opt = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        assert argv[:3] == ["vllm", "bench", "serve"] and opt["--dataset-name"] == "random"
        assert opt["--random-output-len"] == "128" and "--ignore-eos" in argv and "--save-result" in argv
        assert opt["--base-url"] == "http://127.0.0.1:8000" and opt["--endpoint"] == "/v1/completions"
        assert opt["--result-dir"] == str(results / "bench")
        assert opt["--result-filename"] == f"in{opt['--random-input-len']}_qps{opt['--request-rate']}.json"
        assert int(opt["--num-prompts"]) >= 20
        points.add((int(opt["--random-input-len"]), int(opt["--request-rate"])))
    return points


SWEEP = {(i, q) for i in (1024, 2048, 4096, 8192, 16384) for q in (1, 2, 4, 8)}


def check_common(out: str, tmp_path: Path, target: str, n_prefill: int, n_decode: int) -> dict:
    srv = servers(out)
    names = [f"prefill{i}" for i in range(n_prefill)] + [f"decode{i}" for i in range(n_decode)] + ["router"]
    assert list(srv) == names
    for name in names[:-1]:
        s = srv[name]
        assert "vllm serve" in s["body"] and "--kv-transfer-config" in s["body"]
        connector = "KVPushNeuronConnector" if target == "neuron" else "KVPushCudaConnector"
        assert f'"kv_connector":"{connector}"' in s["body"]
        assert s["env"]["FI_PROVIDER"] == "efa" and s["env"]["FI_EFA_USE_DEVICE_RDMA"] == "1"
        assert ("--no-enable-prefix-caching" in s["body"]) == name.startswith("decode")
        assert any(f"doctor --target {target} --plan " in c and c.rstrip("'").endswith(f"{name}.json")
                   for c in s["cmds"]), s["cmds"]
        assert any(f"setsid nohup bash {tmp_path}/results/run/{name}.sh" in c for c in s["cmds"])
        doctor_at = next(i for i, c in enumerate(s["cmds"]) if "doctor" in c)
        start_at = next(i for i, c in enumerate(s["cmds"]) if "setsid" in c)
        assert doctor_at < start_at
    router = srv["router"]["body"]
    urls = {n: re.search(r"^# kvpush \w+ " + n + r": (\S+),", srv[n]["body"], flags=re.M).group(1) for n in names[:-1]}
    assert "kvpush router \\\n  --mode push" in router
    for n, u in urls.items():
        assert f"--{'prefill' if n.startswith('prefill') else 'decode'} {u}" in router
    # every server is healthy before the router starts, the router before the sweep
    waits = [m.group(1) for m in re.finditer(r"curl -sf -m 5 -o /dev/null (\S+)/health; do sleep 5; done", out)]
    assert waits == list(urls.values()) + ["http://127.0.0.1:8000"]
    assert "deadline 1800s" in out
    first_bench = out.index(" bench serve ")
    assert out.rindex("/health;") < first_bench
    assert out.index("# ---- router") > out.index(f"{list(urls.values())[-1]}/health;")
    assert bench_points(out, tmp_path / "results") == SWEEP
    assert out.count(" bench serve ") == 20
    return srv


def neuron_cores(s) -> set[int]:
    from kvpush_common.ops.deploy import parse_range

    return set(parse_range(s["env"]["NEURON_VISIBLE_DEVICES"]))


def test_trainium_1p1d_same_host(tmp_path):
    out = dry_run("neuron", "1p1d-same-host", tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "neuron", 1, 1)
    p, d = srv["prefill0"], srv["decode0"]
    assert p["env"]["NEURON_VISIBLE_DEVICES"] == "0-7" and d["env"]["NEURON_VISIBLE_DEVICES"] == "32-39"
    for s in (p, d):
        assert s["env"]["NEURON_RT_MAP_HBM"] == "1" and s["env"]["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
        assert "unset NEURON_RT_VISIBLE_CORES" in s["body"] and s["host"] == "127.0.0.1"
        assert not any(c.startswith("ssh ") for c in s["cmds"])
        assert '"backend":"LIBFABRIC"' in s["body"] and '"same_host":true' in s["body"]


def test_trainium_1p1d_two_hosts(tmp_path):
    out = dry_run("neuron", "1p1d-two-host", *TWO_HOSTS, tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "neuron", 1, 1)
    p, d = srv["prefill0"], srv["decode0"]
    assert p["host"] == "10.9.0.1" and d["host"] == "10.9.0.2"
    assert p["env"]["NEURON_VISIBLE_DEVICES"] == d["env"]["NEURON_VISIBLE_DEVICES"] == "0-7"
    assert "FI_EFA_ENABLE_SHM_TRANSFER" not in p["env"] and '"same_host":false' in p["body"]
    assert '"host":"10.9.0.1"' in p["body"] and "--prefill http://10.9.0.1:8100" in srv["router"]["body"]
    for name, s in (("prefill0", p), ("decode0", d)):
        assert all(c.startswith(f"ssh {s['host']} ") for c in s["cmds"] if "doctor" in c or "setsid" in c)
        assert any(c.startswith(f"ssh {s['host']} 'cat > ") and c.endswith(f"{name}.json") for c in s["cmds"])


def test_trainium_two_host_needs_both_addresses(tmp_path):
    out = subprocess.run(["bash", str(RUN), "--target", "neuron", "--layout", "1p1d-two-host", "--dry-run"], capture_output=True,
                         text=True, env={**os.environ, "KVPUSH": str(KVPUSH)})
    assert out.returncode == 2 and "needs --prefill-host and --decode-host" in out.stderr


def test_trainium_xpyd(tmp_path):
    out = dry_run("neuron", "xpyd", "--num-prefill", "3", "--num-decode", "2", "--tp", "8", tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "neuron", 3, 2)
    cores = {n: neuron_cores(s) for n, s in srv.items() if n != "router"}
    assert cores["prefill0"] == set(range(0, 8)) and cores["prefill2"] == set(range(16, 24))
    assert cores["decode0"] == set(range(32, 40)) and cores["decode1"] == set(range(40, 48))
    every = [c for cs in cores.values() for c in cs]
    assert len(every) == len(set(every))  # no core shared
    ports = re.findall(r'"port":(\d+)', out)
    assert ports == ["5700", "5708", "5716"]  # each prefill's side-channel ports (base + rank) are its own
    two = dry_run("neuron", "xpyd", "--topology", "two-host", *TWO_HOSTS, tmp_path=tmp_path)
    srv = check_common(two, tmp_path, "neuron", 2, 2)
    assert neuron_cores(srv["prefill1"]) == neuron_cores(srv["decode1"]) == set(range(8, 16))


def test_p5en_set(tmp_path):
    out = dry_run("cuda", "1p1d-same-host", tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "cuda", 1, 1)
    assert srv["prefill0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert srv["decode0"]["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert "NEURON_RT_MAP_HBM" not in srv["prefill0"]["env"]
    out = dry_run("cuda", "1p1d-two-host", *TWO_HOSTS, tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "cuda", 1, 1)
    assert srv["decode0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and srv["decode0"]["host"] == "10.9.0.2"
    out = dry_run("cuda", "xpyd", tmp_path=tmp_path)
    srv = check_common(out, tmp_path, "cuda", 2, 2)
    assert [srv[n]["env"]["CUDA_VISIBLE_DEVICES"] for n in ("prefill0", "prefill1", "decode0", "decode1")] == [
        "0,1", "2,3", "4,5", "6,7"]


@pytest.mark.parametrize("target,want,nixl", [
    # into the SDK plugin's env, whose NIXL (the plugin's pin) stays: nothing is installed over it
    ("neuron", f"-c 'import vllm_neuron, nixl' && python3 -m pip install -e \"{ROOT}\"", False),
    ("cuda", f'-m pip install -e "{ROOT}[cuda]"', True),
])
def test_install_step(tmp_path, target, want, nixl):
    out = dry_run(target, "1p1d-same-host", "--install", tmp_path=tmp_path)
    install = [line for line in out.splitlines() if line.startswith("+ ") and "pip install" in line]
    assert len(install) == 1 and want in install[0] and ("nixl-cu13==1.5.1" in install[0]) == nixl
    assert nixl or "nixl==" not in install[0]
    assert out.index("pip install") < out.index("# ---- prefill0")
    two = dry_run("neuron", "1p1d-two-host", "--install", *TWO_HOSTS, tmp_path=tmp_path)
    assert len([line for line in two.splitlines() if line.startswith("+ ssh ") and "pip install" in line]) == 2


def test_sweep_options_and_unknown_option(tmp_path):
    out = dry_run("cuda", "1p1d-same-host", "--inputs", "512", "--qps", "3", "--duration", "10",
                  "--model", "Qwen/Qwen3-8B", tmp_path=tmp_path)
    bench = [line for line in out.splitlines() if " bench serve " in line]
    assert len(bench) == 1 and "--num-prompts 30" in bench[0] and "--model Qwen/Qwen3-8B" in bench[0]
    bad = subprocess.run(["bash", str(RUN), "--target", "cuda", "--layout", "xpyd", "--dry-run", "--bogus"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


def test_one_runner_shares_the_lib_and_refuses_a_bad_target_or_layout(tmp_path):
    text = RUN.read_text()
    assert 'source "$(dirname "$0")/lib/deploy.sh"' in text and os.access(RUN, os.X_OK)
    assert sorted(p.name for p in (ROOT / "scripts" / "deploy").rglob("*.sh")) == ["deploy.sh", "run.sh"]
    for args, why in ((["--dry-run"], "--target and --layout are required"),
                      (["--target", "gpu", "--layout", "xpyd", "--dry-run"], "--target must be neuron or cuda"),
                      (["--target", "cuda", "--layout", "2p2d", "--dry-run"], "--layout must be")):
        bad = subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, cwd=tmp_path)
        assert bad.returncode == 2 and why in bad.stderr and "usage:" in bad.stderr, bad.stderr
    assert list(tmp_path.iterdir()) == []
    helped = subprocess.run(["bash", str(RUN), "--target", "cuda", "--layout", "xpyd", "--help"], capture_output=True,
                            text=True)
    assert helped.returncode == 0 and "--target cuda --layout xpyd [options]" in helped.stdout
    assert "(default: 2)" in helped.stdout  # cuda xpyd: TP 2 per server (1p1d: 4; neuron: 8)
