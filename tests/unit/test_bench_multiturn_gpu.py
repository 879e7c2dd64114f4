"""The GPU multi-turn benchmark's statistics (scripts/bench/gpu/multiturn_gpu.py): per-mode rows from requests
and router timelines, and the summary ratios the README quotes."""

from scripts.bench.gpu import multiturn_gpu as bench


def req(turn, ttft, tpot=0.005, outcome="ok", exact=True):
    return {"turn": turn, "ttft_s": ttft, "tpot_s": tpot, "outcome": outcome, "exact": exact}


def test_rows_count_turns_skips_and_failures():
    flat = [req(1, 0.2), req(2, 0.02), req(3, 0.04), req(2, None, None, "hung", False)]
    timelines = [{"dispatched": 0.1}, {"prefill_skipped": 0.1}, {"prefill_skipped": 0.1}, {"prefill_cancelled": 9}]
    row = bench.mode_stats("push-reuse", flat, timelines, 0.0)
    assert (row["requests"], row["requests_turn2plus"], row["ok"], row["hung"], row["exact"]) == (4, 3, 3, 1, 3)
    assert row["ttft_p50_turn1_ms"] == 200.0 and row["ttft_p50_turn2plus_ms"] in (20.0, 30.0, 40.0)
    assert (row["prefill_legs_skipped"], row["prefill_legs_cancelled"]) == (2, 1)


def test_summary_ratios_are_against_single_and_vllm_push():
    rows = {"single": {"ttft_p50_turn2plus_ms": 28.0, "tpot_p50_ms": 5.0, "exact": 4, "requests": 4},
            "push-reuse": {"ttft_p50_turn2plus_ms": 25.2, "tpot_p50_ms": 5.5, "exact": 4, "requests": 4,
                           "requests_turn2plus": 3, "prefill_legs_skipped": 3, "prefill_legs_cancelled": 0},
            "nixl-push": {"ttft_p50_turn2plus_ms": 84.0, "tpot_p50_ms": 5.0, "exact": 3, "requests": 4}}
    s = bench.summary(rows)
    assert s["ttft_p50_turn2plus_over_single"] == 0.9 and s["ttft_p50_turn2plus_push_over_nixl_push"] == 0.3
    assert s["tpot_p50_push_reuse_over_single"] == 1.1 and s["ttft_p50_turn2plus_noreuse_over_reuse"] is None
    assert s["prefill_legs_skipped_fraction"] == 1.0 and s["exact_fraction"] == round(11 / 12, 4)


def test_stream_one_collects_token_ids_and_counts_tokens_by_them():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    chunks = [{"choices": [{"text": "", "token_ids": None}]},  # no token yet (a role/usage chunk): not the first
              {"choices": [{"text": "ab", "token_ids": [5, 6]}]}, {"choices": [{"text": "", "token_ids": [7]}]}]
    seen = []

    class SSE(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SSE)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = bench.stream_one(url, [1, 2, 3], 8, 10.0, token_ids=True)
        assert seen[0]["return_token_ids"] is True and r["outcome"] == "ok"
        assert r["ids"] == [5, 6, 7] and r["text"] == "ab" and r["ttft_s"] is not None
        plain = bench.stream_one(url, [1, 2, 3], 8, 10.0)
        assert "return_token_ids" not in seen[1] and "ids" not in plain
    finally:
        server.shutdown()
