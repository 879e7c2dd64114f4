"""The event log never writes a file on a thread other than its writer (the engine thread's hooks only queue),
and the writer itself writes once per step (`flush`), not inside its push path."""

from __future__ import annotations

import threading

from kvpush_common.endpoint.events import EventLog, read_events
from kvpush_common.protocol.identity import TransferKey

KEY = TransferKey("t" * 32, 0)


def test_records_from_another_thread_are_written_only_by_the_writer(tmp_path):
    log = EventLog(tmp_path / "e-consumer-r0.jsonl")
    log.bind_writer()  # this thread plays the endpoint's worker
    engine = threading.Thread(target=log, args=("recv_staged", KEY), kwargs={"blocks": 3})
    engine.start()
    engine.join()
    assert read_events(tmp_path) == []  # queued: the engine thread wrote nothing
    log("registered", KEY)  # the writer's own record is queued too: no file write (no GIL release) mid-step
    assert read_events(tmp_path) == []
    log.flush()  # the worker's end of step
    got = read_events(tmp_path)
    assert [(e["ev"], e["role"]) for e in got] == [("recv_staged", "consumer"), ("registered", "consumer")]
    assert got[0]["blocks"] == 3 and got[0]["t"] <= got[1]["t"]


def test_the_writers_flush_writes_queued_records(tmp_path):
    log = EventLog(tmp_path / "e-producer-r0.jsonl")
    log.bind_writer()
    for ev in ("send_staged", "reported"):
        t = threading.Thread(target=log, args=(ev, KEY))
        t.start()
        t.join()
    log.flush()
    assert [e["ev"] for e in read_events(tmp_path)] == ["send_staged", "reported"]


def test_before_a_writer_is_bound_every_thread_writes_at_once(tmp_path):
    log = EventLog(tmp_path / "e-producer-r0.jsonl")
    t = threading.Thread(target=log, args=("kv_ready", KEY))
    t.start()
    t.join()
    assert [e["ev"] for e in read_events(tmp_path)] == ["kv_ready"]

