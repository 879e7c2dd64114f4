"""The handoff micro-benchmark: one push timed stage by stage on GPUs (gpu_handoff) and push vs pull in a
simulated vLLM-shaped engine loop (engine_loop, with engines, handoff_modes, kvslab, workmodel, plot_engine_loop);
push_pair is the run loop of one producer/consumer pair that gpu_handoff and two probes share."""
