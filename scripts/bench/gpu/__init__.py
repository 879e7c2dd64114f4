"""End-to-end drivers in real CUDA vLLM (the GPU machine): single-turn requests (vllm_gpu, with vllm_summary) and
multi-turn chat (multiturn_gpu); run through scripts/bench/e2e.py.  The shell helpers here set up the GPU machine."""
