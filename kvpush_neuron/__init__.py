"""kvpush Neuron backend (Trainium HBM through NIXL LIBFABRIC/EFA).

runtime.py is the device interface (real and simulated Neuron runtime), startup.py the documented
start-up rules, kv_cache.py the vLLM Neuron plugin's KV layout, slab.py test/bench slabs, efa.py the
trn2 EFA preflight, hwcheck.py the first-run smoke check, connector.py the vLLM entry class.
Imports only `kvpush_common`.
"""
