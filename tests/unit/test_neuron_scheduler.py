"""What the vLLM Neuron plugin's scheduler reads of kvpush's requests (docs/neuron.md), on CPU:

- it pads a prefill to a compiled bucket unless the request's kv_transfer_params lack `do_remote_decode`
  (`NeuronScheduler._should_skip_prefilling_padding_in_di`): every request an instance computes itself -- kvpush's
  prefill legs, its identity probes, a decode instance's local prefills (a declined or failed receive, a sibling
  sample's prefix, a rejected leg) -- carries it; a decode's one-token recompute after its KV load does not;
- in a sliding window, the decode's recompute of the prompt's last token reads from token N - window, the bound the
  plugin's NeuronNixlConnectorScheduler uses, while the prefill frees the blocks before N - window + 1: kvpush asks
  for the recompute's block and computes the prompt itself at the one remainder where the prefill freed it.
"""

from types import SimpleNamespace

import pytest

from kvpush_common.router.legs import identity_probe_params, local_body, push_decode_params, push_prefill_params
from kvpush_common.protocol.legs import ProducerIdentity, read_leg
from kvpush_common.vllm.kv_groups import window_block_freed_on_prefill, window_first_token
from kvpush_common.vllm.scheduler import SchedulerSide
from kvpush_neuron.connector import window_block_missing
from kvpush_neuron.testing.simulated_plugin import (SimulatedNeuronScheduler, UnpaddedPrefillError, plugin_skips_padding,
                                            plugin_unpadded_prefills)
from test_parallel_sampling_scheduler import PRODUCER, blocks, request, settings

DECODE = {"kvpush": "decode", "transfer_id": "t", "attempt": 0, "producer": PRODUCER}


def step(scheduled: dict, computed: dict):
    """A SchedulerOutput as the plugin reads it: new requests with their pre-step num_computed_tokens."""
    return SimpleNamespace(num_scheduled_tokens=scheduled, kv_connector_metadata=object(), scheduled_cached_reqs=None,
                           scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c)
                                               for r, c in computed.items()])


def test_every_leg_an_instance_computes_is_padded_by_the_plugin():
    ident = ProducerIdentity(**PRODUCER)
    for params in (push_prefill_params("t", 0), push_prefill_params("t", 2, consumer_tp=4), identity_probe_params(),
                   identity_probe_params("t", 1), local_body({"kv_transfer_params": DECODE}).get("kv_transfer_params")):
        assert not plugin_skips_padding(params, True), params
    assert plugin_skips_padding(push_decode_params("t", 0, ident), True)  # D's one-token recompute after its load
    # the mark changes nothing in how kvpush reads its legs
    assert read_leg(push_prefill_params("t", 2, consumer_tp=4)).consumer_tp == 4
    assert read_leg(identity_probe_params("t", 1)).transfer_id == "t"


def test_the_plugins_decision_without_a_connector_or_params():
    assert not plugin_skips_padding({"kvpush": "decode"}, False)  # no connector metadata: padded
    assert not plugin_skips_padding(None, True)
    assert plugin_skips_padding({"do_remote_decode": False}, True)


@pytest.mark.parametrize("case", ["declined", "recomputed after a failed receive", "sibling received"])
def test_a_decode_instances_local_prefill_is_marked_padded(case):
    s = SchedulerSide(settings("consumer", local_prefill_max_tokens=64))
    r = request("r-1", dict(DECODE), tokens=300)
    if case == "declined":
        assert s.get_num_new_matched_tokens(r, 256) == (0, False)
    elif case == "recomputed after a failed receive":
        assert s.get_num_new_matched_tokens(r, 0) == (300, True)
        s.update_state_after_alloc(r, blocks(range(1, 11)), 300)
        assert "do_remote_decode" not in r.kv_transfer_params  # the receive: D recomputes one token, unpadded
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM asks again for the recompute
    else:
        first = request("r-0", dict(DECODE), tokens=300)
        s.get_num_new_matched_tokens(first, 0)
        s.update_state_after_alloc(first, blocks(range(1, 11)), 300)
        s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"r-0"}))
        assert s.get_num_new_matched_tokens(r, 288) == (0, False)
    assert r.kv_transfer_params["do_remote_decode"] is True
    assert plugin_unpadded_prefills({"r-1": r}, step({"r-1": 44}, {"r-1": 256})) == []
    assert plugin_unpadded_prefills({"r-1": request("r-1", DECODE, 300)}, step({"r-1": 44}, {"r-1": 256}))  # unmarked
    s.build_connector_meta(None)
    finished = s.request_finished(r, [1, 2])  # still read as the decode leg it came as
    if case == "recomputed after a failed receive":  # still awaited here: its abort goes to the producer
        assert finished == (True, None) and [op.req_id for op in s.build_connector_meta(None).aborts] == ["r-1"]
    assert r.request_id not in s._marked


def test_a_rejected_leg_recomputed_on_a_decode_instance_is_marked_padded():
    s = SchedulerSide(settings("consumer"))
    r = request("r", {"kvpush": "decode", "transfer_id": "t"}, tokens=100)  # no producer: a BadLeg
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert r.kv_transfer_params["do_remote_decode"] is True


def test_the_simulated_scheduler_stops_a_prefill_the_plugin_would_not_pad():
    decode = request("d", DECODE, tokens=300)
    prefill = request("p", push_prefill_params("t", 0), tokens=300)
    so = step({"d": 1, "p": 300}, {"d": 299, "p": 0})
    assert plugin_unpadded_prefills({"d": decode, "p": prefill}, so) == []  # the recompute and a marked prefill
    unmarked = request("p", {"kvpush": "prefill", "transfer_id": "t"}, tokens=300)  # kvpush's leg before the mark
    assert plugin_unpadded_prefills({"p": unmarked}, so) == ["p (300 tokens, kv_transfer_params "
                                                           "{'kvpush': 'prefill', 'transfer_id': 't'})"]
    sched = object.__new__(SimulatedNeuronScheduler)
    sched.requests = {"p": unmarked}
    base = SimulatedNeuronScheduler.__mro__[1]
    orig = base.schedule
    try:
        base.schedule = lambda self, throttle_prefills=False: so  # vLLM 0.32's signature
        with pytest.raises(UnpaddedPrefillError, match="do_remote_decode"):
            sched.schedule(throttle_prefills=True)
        sched.requests = {"p": prefill}
        assert sched.schedule() is so
    finally:
        base.schedule = orig


def _skipped(num_computed_tokens: int, window: int) -> int:
    """vLLM's own SlidingWindowManager.get_num_skipped_tokens (the installed release's code)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    return SlidingWindowManager.get_num_skipped_tokens(
        SimpleNamespace(sliding_window=window, extra_retained_tokens=0), num_computed_tokens)


@pytest.mark.parametrize("window,bs", [(64, 32), (96, 32), (128, 16)])
def test_the_window_bound_at_every_block_boundary_remainder(window, bs):
    """For prompts of every length mod block_size, below and above the window: the decode asks for (and vLLM
    allocates on the decode, anchored where kvpush's registration starts) the block of the first token its
    recompute of token N - 1 reads, and the prefill still holds every block it is asked for; at the remainder
    where the prefill freed that block (N mod bs == bs - 1), the decode computes the prompt itself."""
    declined = set()
    for n in range(2, window + 3 * bs):
        needed = _skipped(n - 1, window) // bs  # the recompute of token n - 1 attends tokens from n - window
        held_by_prefill = _skipped(n, window) // bs  # blocks freed at the prefill's finish
        first = window_first_token(n, 0, window, bs)
        assert first == needed * bs, (n, first, needed)  # the plugin's bound N - window, block-aligned
        missing = window_block_missing(window, bs, n, 0)
        assert bool(missing) == window_block_freed_on_prefill(n, window, bs) == (needed < held_by_prefill), n
        if missing:
            declined.add(n % bs)
            assert f"block of token {n - window}" in missing
    assert declined == {bs - 1}
    # a local prefix hit past the window's first token: the decode has that block itself
    n = window + 2 * bs - 1
    assert window_block_missing(window, bs, n, (n - window) // bs * bs + bs) is None


def test_the_neuron_scheduler_side_declines_where_the_window_block_is_gone():
    s = SchedulerSide(settings("consumer"))
    s.computes_here = lambda n, c: window_block_missing(64, 32, n, c)
    r = request("r", dict(DECODE), tokens=64 + 32 + 31)  # 127 tokens: token 63's block freed on the prefill
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    [op] = s.build_connector_meta(None).declines
    assert "block of token 63" in op.reason and r.kv_transfer_params["do_remote_decode"] is True
    ok = request("q", dict(DECODE), tokens=128)
    assert s.get_num_new_matched_tokens(ok, 0) == (128, True)
