"""The device entry classes are KVPushConnectors and refuse to start until their backend exists."""

import pytest


@pytest.mark.parametrize("module,name", [("kvpush_neuron.connector", "KVPushNeuronConnector")])
def test_entry_class_binds_its_backend_or_says_why_not(module, name):
    import importlib

    from kvpush_common.vllm.connector import KVPushConnector

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, KVPushConnector)
    with pytest.raises(RuntimeError, match="not available"):
        cls.make_backend(object.__new__(cls), {}, 0)
