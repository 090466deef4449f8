"""KV transfer failures per (prefill, decode) pair from the real log lines, and the side to restart."""

from __future__ import annotations

from pathlib import Path

from nodeagent.config.layout import cluster_layout, layout_resolver
from nodeagent.config.load import load_config
from nodeagent.vllm.kv_transfer import (
    RestartEngine,
    TransferTimeouts,
    TransportSuspect,
    parse_transfer_failure,
)

EIGHT = Path(__file__).resolve().parents[1] / "config" / "dsv4-flash-a2-8node.yaml"
# As vllm-ascend #7401, #4866, #7846 quote them (addresses changed to the 8-node example's).
CONNECT_TIMEOUT = ("E20260608 14:45:44.404089 342420 ascend_direct_transport.cpp:1107] Connect timeout to: "
                   "{ip}:20033, you can increase the timeout duration to reduce the ASCEND_CONNECT_TIMEOUT environment "
                   "variable.")  # fmt: skip
CONNECT_FAILED = ("E1210 03:24:54.778028 2548307 ascend_direct_transport.cpp:820] Failed to connect to target: "
                  "{ip}:25389, status: 103900")
NO_ACK = ("(Worker_DP0_TP0 pid=1) ERROR 06-08 14:45:44 [mooncake_hybrid_connector.py:1002] Failed to receive ACK for "
          "request. request_id=chatcmpl-1, source={ip}:{port}. ")
REQ_FAILED = ("(Worker_DP0_EP0 pid=335952) ERROR 06-08 14:45:44 [mooncake_hybrid_connector.py:551] Mooncake transfer "
              "failed for request chatcmpl-270f82b6")
SYNC = "I0331 02:49:30.617945 803444 transfer_engine_py.cpp:454] Sync batch data transfer timeout after 33061142969ns"
EXPIRED = ("ERROR 06-08 [mooncake_connector.py:236] Force freed expired request: chatcmpl-9. Reason: Request exceeded "
           "timeout threshold (480 seconds). Action: Resources have been forcibly released to prevent memory leak.")
KINDS = {"prefill0": "prefill", "prefill1": "prefill", "prefill2": "prefill", "prefill3": "prefill",
         "decode0": "decode"}  # fmt: skip
IP = {"prefill0": "10.0.0.1", "prefill1": "10.0.0.2", "prefill2": "10.0.0.3", "prefill3": "10.0.0.4"}


def test_parses_the_lines() -> None:
    f = parse_transfer_failure(CONNECT_TIMEOUT.format(ip="10.0.0.2"))
    assert f is not None and (f.kind, f.host, f.port) == ("connect-timeout", "10.0.0.2", 20033)
    f = parse_transfer_failure(NO_ACK.format(ip="10.0.0.3", port=30004))
    assert f is not None and (f.kind, f.host, f.port) == ("no-ack", "10.0.0.3", 30004)
    assert parse_transfer_failure(CONNECT_FAILED.format(ip="10.0.0.1")).kind == "connect-failed"  # type: ignore[union-attr]
    for line, kind in ((REQ_FAILED, "request-failed"), (SYNC, "sync-timeout"), (EXPIRED, "expired")):
        f = parse_transfer_failure(line)
        assert f is not None and f.kind == kind and f.host is None
    assert parse_transfer_failure("INFO 06-08 KV cache transfer for request x took 3.2 ms") is None


def test_layout_resolver_maps_peers_to_engines() -> None:
    resolve = layout_resolver(cluster_layout(load_config(EIGHT, node="a2-0")))
    assert resolve("10.0.0.2", 20033) == "prefill1", "a random ADXL port: the only PD group on that IP"
    assert resolve("10.0.0.3", 30204) == "prefill2", "a handshake port"
    assert resolve("10.0.0.6", 30409) == "decode0"
    assert resolve("10.9.9.9", 20033) is None


def feed(counter: TransferTimeouts, engine: str, lines: list[str], start: float, step: float = 2.0) -> float:
    resolve = layout_resolver(cluster_layout(load_config(EIGHT, node="a2-0")))
    t = start
    for line in lines:
        counter.record(engine, line, t, resolve)
        t += step
    return t


def test_a_prefill_that_fails_with_every_decode_is_restarted_alone() -> None:
    """4P1D: decode0 sees prefill2 time out again and again, the other prefills are fine → prefill2, not decode0."""
    counter = TransferTimeouts(KINDS, threshold=5)
    t = feed(counter, "decode0", [CONNECT_TIMEOUT.format(ip=IP["prefill2"])] * 6, 0.0)
    t = feed(counter, "decode0", [CONNECT_TIMEOUT.format(ip=IP["prefill0"])], t)
    assert counter.pair_counts(t) == {("prefill2", "decode0"): 6, ("prefill0", "decode0"): 1}
    decision = counter.decide(t)
    assert decision == [RestartEngine("prefill2", "6 KV transfer failures in 300s with every decode engine "
                                                  "(decode0)")]  # fmt: skip


def test_below_the_threshold_or_outside_the_window_nothing() -> None:
    counter = TransferTimeouts(KINDS, threshold=5, window_s=300)
    t = feed(counter, "decode0", [CONNECT_TIMEOUT.format(ip=IP["prefill1"])] * 4, 0.0)
    assert counter.decide(t) is None, "4 < 5"
    feed(counter, "decode0", [CONNECT_TIMEOUT.format(ip=IP["prefill1"])] * 2, 400.0)
    assert counter.decide(403.0) is None, "the first four left the window"


def test_a_decode_that_fails_with_every_prefill_is_restarted_not_the_prefills() -> None:
    counter = TransferTimeouts(KINDS, threshold=3)
    t = 0.0
    for name in ("prefill0", "prefill1", "prefill2", "prefill3"):
        t = feed(counter, "decode0", [NO_ACK.format(ip=IP[name], port=30000 + 100 * int(name[-1]))] * 3, t)
    decision = counter.decide(t)
    assert isinstance(decision, list) and [r.engine for r in decision] == ["decode0"], decision
    assert "with every prefill engine (prefill0, prefill1, prefill2, prefill3)" in decision[0].reason


def test_one_failure_logged_by_every_tp_worker_counts_once() -> None:
    counter = TransferTimeouts(KINDS, threshold=2)
    line = CONNECT_TIMEOUT.format(ip=IP["prefill3"])
    feed(counter, "decode0", [line] * 8, 0.0, step=0.01)  # TP0..TP7 within 80 ms
    assert counter.pair_counts(1.0) == {("prefill3", "decode0"): 1}


def test_every_pair_failing_in_1p1d_is_the_transport_not_an_engine() -> None:
    kinds = {"prefill0": "prefill", "decode0": "decode"}
    counter = TransferTimeouts(kinds, threshold=3)
    feed(counter, "decode0", [CONNECT_TIMEOUT.format(ip=IP["prefill0"])] * 3, 0.0)
    decision = counter.decide(10.0)
    assert isinstance(decision, TransportSuspect) and "prefill0↔decode0 3" in decision.reason


def test_lines_without_a_peer_are_not_counted_for_a_pair() -> None:
    counter = TransferTimeouts(KINDS, threshold=1)
    feed(counter, "decode0", [REQ_FAILED, SYNC], 0.0)
    feed(counter, "prefill1", [EXPIRED], 10.0)
    assert counter.pair_counts(20.0) == {} and counter.decide(20.0) is None
    assert len(counter.events) == 3, "kept against the engine that logged them"
