"""The bind-race rule: recognise a start that lost a port, retry it after 1-5 s without counting, N times in a row."""

from __future__ import annotations

import socket
import subprocess
import sys

from nodeagent.core.failure import Failure
from nodeagent.node.bindrace import MAX_IN_ROW, BindRaceRetries, bind_race_port, is_bind_race

# The lines as the issues quote them (vllm-ascend #6455/#8938, vllm #7514, vllm #11617, vllm-ascend #405).
ZMQ = ("zmq.error.ZMQError: Address already in use (addr='tcp://10.0.0.1:30012')",
       "RuntimeError: KV Cache sending/receiving thread failed to start.")  # fmt: skip
UVICORN = ("ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): address already in use",)
TORCH = ("RuntimeError: The server socket has failed to listen on any local network address. useIpv6: 0, code: -98, "
         "name: EADDRINUSE, message: address already in use",)
HCCL = ("EJ0003: [PID: 159] 2025-03-26-17:01:02.816.428 Failed to bind the IP port. Reason: The IP address and port "
        "have been bound already.",
        "host nic listen start failed, port[60000], return[11][FUNC:StartListenSocket]")
OOM = ("RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB",)


def exit_failure(tail: tuple[str, ...], code: int | None = 1, uptime: float | None = 40.0,
                 was_up: bool = False) -> Failure:
    return Failure("exit", "exited with code 1", code=code, uptime_s=uptime, output_tail=tail, was_up=was_up)


def test_recognises_the_texts_vllm_uvicorn_torch_and_hccl_print() -> None:
    for tail in (ZMQ, UVICORN, TORCH, HCCL):
        assert is_bind_race(tail, 1, 12.0), tail
    assert bind_race_port(ZMQ) == 30012 and bind_race_port(UVICORN) == 8000 and bind_race_port(HCCL) == 60000
    assert bind_race_port(TORCH) is None


def test_not_a_bind_race() -> None:
    assert not is_bind_race(OOM, 1, 12.0), "another error"
    assert not is_bind_race(ZMQ, -9, 12.0), "killed by a signal: someone else's doing"
    assert not is_bind_race(ZMQ, None, 12.0) and not is_bind_race(ZMQ, 0, 12.0)
    assert not is_bind_race(ZMQ, 1, 7200.0), "two hours in: not a start"
    assert not is_bind_race(ZMQ, 1, 12.0, was_up=True), "it came up: a crash, not a start"


def test_a_real_bind_error_is_recognised() -> None:
    """A real process that finds its port taken, exactly as Python reports it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    tail = tuple(done.stderr.splitlines()[-3:])
    assert done.returncode == 1 and is_bind_race(tail, done.returncode, 0.1), tail


def test_retry_jittered_uncounted_at_most_n_in_a_row_then_counted() -> None:
    retries = BindRaceRetries("vllm-dp3")
    taken = [retries.on_failure(exit_failure(ZMQ)) for _ in range(MAX_IN_ROW)]
    assert [r.attempt for r in taken if r] == [1, 2, 3]
    assert all(r is not None and 1.0 <= r.delay_s <= 5.0 for r in taken)
    assert len({r.delay_s for r in taken if r}) == MAX_IN_ROW, "jittered"
    assert "port 30012 was taken" in taken[0].reason and "not counted" in taken[0].reason  # type: ignore[union-attr]
    assert retries.on_failure(exit_failure(ZMQ)) is None, "the 4th in a row counts as a failure"
    assert retries.on_failure(exit_failure(ZMQ)) is not None, "then the streak starts again"
    same = BindRaceRetries("vllm-dp3")
    assert [same.on_failure(exit_failure(ZMQ)).delay_s for _ in range(3)] == [r.delay_s for r in taken], "seeded"  # type: ignore[union-attr]
    other = BindRaceRetries("vllm-dp4")
    assert other.on_failure(exit_failure(ZMQ)).delay_s != taken[0].delay_s, "ranks do not retry in lockstep"  # type: ignore[union-attr]


def test_other_failures_and_coming_up_reset_the_streak() -> None:
    retries = BindRaceRetries("vllm", max_in_row=2)
    assert retries.on_failure(exit_failure(ZMQ)) and retries.on_failure(exit_failure(ZMQ))
    assert retries.on_failure(exit_failure(OOM)) is None
    assert retries.on_failure(exit_failure(ZMQ)) is not None, "an OOM in between ended the streak"
    retries.on_up()
    assert retries.on_failure(exit_failure(ZMQ)).attempt == 1  # type: ignore[union-attr]
    assert retries.on_failure(Failure("liveness", "probe failed", output_tail=ZMQ)) is None, "only a process exit"
