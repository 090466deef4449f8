"""The fault-tolerance client against the stand-in's copy of vLLM 0.32's API: two real rank processes of one
external-LB group, their faults, `retry` recovering them or failing, and the rule judging what the client read;
and `apply` against a small server with the earlier upstream router's shape (synchronous, its own keys).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import free_port
from test_standin import MODEL_PATH, Launcher, StandIn
from vllm_standin.fault_tolerance import settings_from_argv
from vllm_standin.vllm import main

from nodeagent.vllm.ft_client import (
    FtNotServed,
    FtRejected,
    FtUnreachable,
    apply,
    apply_body,
    fetch_status,
    parse_status,
    supports_fault_tolerance,
)
from nodeagent.vllm.ft_rules import Escalate, FtSituation, Instruct, RankStatus, Recovered, attempt_for, decide

FT_FLAGS = ["--enable-fault-tolerance", "--fault-tolerance-config", '{"engine_recovery_timeout_sec": 30}',
            "--all2all-backend", "deepep_low_latency"]


def rank_argv(rank: int, port: int, rpc_port: int, ft: list[str] | None = None) -> list[str]:
    return ["serve", MODEL_PATH, "--port", str(port), "--data-parallel-size", "2", "--data-parallel-rank", str(rank),
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            *(FT_FLAGS if ft is None else ft)]


@pytest.fixture
def launcher() -> Iterator[Launcher]:
    workdir = Path(tempfile.mkdtemp(prefix="vft-", dir="/tmp"))
    launch = Launcher(workdir)
    try:
        yield launch
    finally:
        launch.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def start_group(launcher: Launcher, ft: list[str] | None = None) -> list[StandIn]:
    rpc_port = free_port()
    ranks = []
    for rank in range(2):
        port = free_port()
        ranks.append(launcher.start(rank_argv(rank, port, rpc_port, ft), port=port, wait=False))
    for instance in ranks:
        instance.wait_ready(1)
    return ranks


async def states(session: aiohttp.ClientSession, ranks: list[StandIn]) -> dict[int, RankStatus]:
    out: dict[int, RankStatus] = {}
    for rank, instance in enumerate(ranks):
        try:
            (status,) = await fetch_status(session, instance.url, timeout_s=2)
        except FtUnreachable:
            status = RankStatus(rank, "unreachable")
        out[status.rank] = status
    return out


async def wait_states(session: aiohttp.ClientSession, ranks: list[StandIn], want: list[str],
                      timeout: float = 10.0) -> dict[int, RankStatus]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        seen = await states(session, ranks)
        if [seen[r].state for r in range(len(ranks))] == want:
            return seen
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"ranks stayed {seen}, wanted {want}")
        await asyncio.sleep(0.05)


async def set_fault(session: aiohttp.ClientSession, instance: StandIn, mode: str) -> None:
    async with session.post(instance.url + "/standin/ft_fault", json={"mode": mode}) as resp:
        assert resp.status == 200, await resp.text()


def situation(seen: dict[int, RankStatus], now: float, **kw: object) -> FtSituation:
    return FtSituation(ranks=(0, 1), statuses=seen, asked=True, supported=True, support_reason="endpoint", now=now,
                       recovery_timeout_s=30, retry_timeout_s=10, fault_at=now, **kw)  # type: ignore[arg-type]


# ---- pure ---------------------------------------------------------------------------------------------------


def test_support_comes_from_the_endpoint_before_the_version() -> None:
    assert supports_fault_tolerance(status_code=200).supported is True
    assert supports_fault_tolerance("0.32.0", status_code=404).supported is False
    assert supports_fault_tolerance("0.32.0+cpu").supported is True
    assert supports_fault_tolerance("v0.33.1rc1").supported is True
    assert supports_fault_tolerance("0.11.0rc3").supported is False
    assert supports_fault_tolerance("1.0.0").supported is True
    assert supports_fault_tolerance("nightly").supported is None
    assert supports_fault_tolerance(status_code=500).supported is None
    assert supports_fault_tolerance().supported is None


def test_parse_status_reads_the_wheels_shape_and_refuses_others() -> None:
    body = {"schema_version": 1, "total_engines": 1, "engines": [
        {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError", "ft_error": "x", "last_ft_request_id": "r"}]}
    assert parse_status(body) == [RankStatus(1, "unhealthy", "RuntimeError", "x", "r")]
    for bad in ({"schema_version": 2, "engines": []}, {"schema_version": 1, "engines": {}},
                {"schema_version": 1, "engines": [{"id": "0", "status": "healthy"}]},
                {"schema_version": 1, "engines": [{"id": 0, "status": "paused"}]}, [1]):
        with pytest.raises(FtRejected):
            parse_status(bad)


def test_stand_in_takes_the_wheels_flags_and_refuses_what_vllm_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    ft = settings_from_argv(["m", "--data-parallel-rank", "1", *FT_FLAGS])
    assert ft.routes and ft.engine and ft.engine_recovery_timeout_sec == 30 and ft.refusal() is None
    only_config = settings_from_argv(["m", "--fault-tolerance-config={\"engine_recovery_timeout_sec\": 5}"])
    assert only_config.engine and not only_config.routes
    with pytest.raises(ValueError, match="Unexpected keyword argument"):
        settings_from_argv(["m", "--fault-tolerance-config", '{"engine_recovery_timeout_sec": 5, "retry": 1}'])
    with pytest.raises(ValueError, match="invalid parse_dataclass value"):
        settings_from_argv(["m", "--fault-tolerance-config", "{"])
    assert "external load balancer" in (settings_from_argv(["m", *FT_FLAGS]).refusal() or "")
    no_a2a = settings_from_argv(["m", "--data-parallel-rank", "0", "--enable-fault-tolerance"])
    assert "FT-capable all2all backend" in (no_a2a.refusal() or "") and "allgather_reducescatter" in no_a2a.refusal()
    two_servers = settings_from_argv(["m", "--data-parallel-external-lb", "--api-server-count", "2", *FT_FLAGS])
    assert "--api-server-count=1" in (two_servers.refusal() or "")
    assert settings_from_argv(["m", "--no-enable-fault-tolerance"]).refusal() is None
    assert main(["serve", MODEL_PATH, "--enable-fault-tolerance"]) == 1
    assert "external load balancer mode" in capsys.readouterr().err
    assert main(["serve", MODEL_PATH, "--fault-tolerance-config", "[]"]) == 2


# ---- against two stand-in ranks -----------------------------------------------------------------------------


async def test_a_transient_fault_is_seen_by_the_survivor_and_a_retry_recovers_the_group(launcher: Launcher) -> None:
    ranks = start_group(launcher)
    async with aiohttp.ClientSession() as session:
        seen = await wait_states(session, ranks, ["healthy", "healthy"])
        assert seen[0] == RankStatus(0, "healthy")
        async with session.get(ranks[0].url + "/fault_tolerance/status") as resp:
            assert resp.status == 200
            assert await resp.json() == {"schema_version": 1, "total_engines": 1,
                                         "engines": [{"id": 0, "status": "healthy"}]}
            assert supports_fault_tolerance("0.27.0+standin", status_code=resp.status).supported is True
        await set_fault(session, ranks[1], "transient")
        seen = await wait_states(session, ranks, ["unhealthy", "unhealthy"])
        assert seen[0].fault_info == "RuntimeError"
        decision = decide(situation(seen, 100.0, failed_rank=1))
        assert isinstance(decision, Instruct) and decision.ranks == (0, 1)
        ids = {rank: await apply(session, ranks[rank].url, "retry") for rank in decision.ranks}
        attempt = attempt_for(decision, 100.0, ids)
        seen = await wait_states(session, ranks, ["healthy", "healthy"])
        assert decide(situation(seen, 101.0, attempt=attempt)) == Recovered(attempt)
        assert all(r.ft_error is None for r in seen.values())
        # the group stays healthy: the recovered rank's old fault is not seen again
        await asyncio.sleep(0.3)
        assert [s.state for s in (await states(session, ranks)).values()] == ["healthy", "healthy"]


async def test_a_chat_sent_during_the_fault_waits_for_the_retry_as_in_vllm(launcher: Launcher) -> None:
    """vLLM parks the busy loop while a rank is unhealthy: a request neither fails nor runs until the retry
    (this is what makes the agent's liveness canary fail during an episode: `nodeagent.node.liveness_hold`)."""
    ranks = start_group(launcher)
    body = {"model": MODEL_PATH, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        await wait_states(session, ranks, ["healthy", "healthy"])
        await set_fault(session, ranks[1], "transient")
        await wait_states(session, ranks, ["unhealthy", "unhealthy"])
        chat = asyncio.ensure_future(session.post(ranks[0].url + "/v1/chat/completions", json=body))
        done, _ = await asyncio.wait({chat}, timeout=1.0)
        assert not done, "a chat during the fault is answered only after the retry"
        for rank in (0, 1):
            await apply(session, ranks[rank].url, "retry")
        resp = await asyncio.wait_for(chat, 10)
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 2
        resp.release()


async def test_a_retry_that_fails_reports_its_request_id_and_escalates(launcher: Launcher) -> None:
    ranks = start_group(launcher)
    async with aiohttp.ClientSession() as session:
        await wait_states(session, ranks, ["healthy", "healthy"])
        await set_fault(session, ranks[1], "retry_fails")
        seen = await wait_states(session, ranks, ["unhealthy", "unhealthy"])
        decision = decide(situation(seen, 100.0))
        assert isinstance(decision, Instruct)
        ids = {rank: await apply(session, ranks[rank].url, "retry") for rank in decision.ranks}
        attempt = attempt_for(decision, 100.0, ids)
        for _ in range(100):
            seen = await states(session, ranks)
            if seen[0].ft_error and seen[1].ft_error:
                break
            await asyncio.sleep(0.05)
        assert seen[1].last_ft_request_id == ids[1] and "retry_fails" in (seen[1].ft_error or "")
        assert seen[0].last_ft_request_id == ids[0] and "peer's retry failed" in (seen[0].ft_error or "")
        verdict = decide(situation(seen, 101.0, attempt=attempt))
        assert isinstance(verdict, Escalate) and verdict.reason.startswith("retry failed on rank")


async def test_a_hung_retry_runs_into_the_timeout_and_a_healthy_rank_refuses_retry(launcher: Launcher) -> None:
    ranks = start_group(launcher)
    async with aiohttp.ClientSession() as session:
        await wait_states(session, ranks, ["healthy", "healthy"])
        refused = await apply(session, ranks[0].url, "retry")
        (status,) = await fetch_status(session, ranks[0].url)
        assert status.state == "healthy" and status.last_ft_request_id == refused
        assert status.ft_error == "[FT] Rejecting retry on engine 0: status is HEALTHY"
        await set_fault(session, ranks[0], "retry_hangs")
        seen = await wait_states(session, ranks, ["unhealthy", "unhealthy"])
        decision = decide(situation(seen, 100.0))
        assert isinstance(decision, Instruct)
        attempt = attempt_for(decision, 100.0, {r: await apply(session, ranks[r].url, "retry") for r in (0, 1)})
        await asyncio.sleep(0.5)
        seen = await states(session, ranks)
        assert [s.state for s in seen.values()] == ["unhealthy", "unhealthy"]
        assert decide(situation(seen, 100.0 + 10, attempt=attempt)) == Escalate("retry timed out after 10 s")


async def test_apply_errors_are_the_wheels(launcher: Launcher) -> None:
    ranks = start_group(launcher)
    url = ranks[0].url + "/fault_tolerance/apply"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(FtRejected, match=r"400 Invalid instruction: 'pause'\."):
            await apply(session, ranks[0].url, "pause")  # type: ignore[arg-type]
        cases = [({"params": {}}, "'instruction' is required."),
                 ({"instruction": "retry", "params": []}, "'params' must be an object."),
                 ([1], "Request body must be a JSON object.")]
        for body, message in cases:
            async with session.post(url, json=body) as resp:
                assert resp.status == 400
                assert await resp.json() == {"error": {"message": message, "type": "Bad Request", "param": None,
                                                       "code": 400}}
        async with session.post(url, data=b"{", headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["message"] == "Invalid JSON format"
        async with session.post(url, data=b"{}", headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 400 and "Unsupported Media Type" in (await resp.json())["error"]["message"]
        async with session.post(url, json={"instruction": "retry"}) as resp:
            body = await resp.json()
            assert resp.status == 202 and body["message"].startswith("Request accepted") and body["request_id"]
        # the wheel's validator reads `instruction` and `params` only: the earlier shape's keys beside them pass
        async with session.post(url, json=apply_body("retry", 30)) as resp:
            body = await resp.json()
            assert resp.status == 202 and body["request_id"]


async def test_a_killed_rank_makes_the_survivor_unhealthy_and_the_rule_escalates(launcher: Launcher) -> None:
    ranks = start_group(launcher)
    async with aiohttp.ClientSession() as session:
        await wait_states(session, ranks, ["healthy", "healthy"])
        os.kill(ranks[1].proc.pid, signal.SIGKILL)
        ranks[1].proc.wait(timeout=5)
        seen = await wait_states(session, ranks, ["unhealthy", "unreachable"])
        decision = decide(situation(seen, 100.0, failed_rank=1))
        assert isinstance(decision, Escalate) and decision.reason.startswith("rank 1 is gone")
        with pytest.raises(FtUnreachable, match="ClientConnectorError"):
            await fetch_status(session, ranks[1].url, timeout_s=1)


async def test_no_retry_within_the_engines_recovery_timeout_kills_the_engine(launcher: Launcher) -> None:
    ranks = start_group(launcher, ft=["--enable-fault-tolerance", "--fault-tolerance-config",
                                      '{"engine_recovery_timeout_sec": 1}', "--all2all-backend", "nixl_ep"])
    async with aiohttp.ClientSession() as session:
        await wait_states(session, ranks, ["healthy", "healthy"])
        await set_fault(session, ranks[1], "dead")
        seen = await wait_states(session, ranks, ["unhealthy", "dead"])
        assert seen[1].fault_info is None and seen[0].fault_info == "RuntimeError"
    assert ranks[0].wait_exit(10) == 1 and ranks[1].wait_exit(10) == 1
    assert "[FT] No recovery within 1s timeout." in ranks[0].output()


async def test_without_the_flag_there_are_no_routes(launcher: Launcher) -> None:
    port = free_port()
    instance = launcher.start(["serve", MODEL_PATH, "--port", str(port)], port=port)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(FtNotServed):
            await fetch_status(session, instance.url)
        with pytest.raises(FtNotServed):
            await apply(session, instance.url, "retry")


# ---- the earlier upstream shape ------------------------------------------------------------------------------


def test_one_body_carries_both_shapes() -> None:
    assert apply_body("retry", 29.2) == {"instruction": "retry", "params": {}, "fault_tolerance_instruction": "retry",
                                         "fault_tolerance_timeout": 30}  # fmt: skip
    assert apply_body("retry", 0.2)["fault_tolerance_timeout"] == 1, "a positive int, as that router requires"


class EarlierRouter:
    """`POST /fault_tolerance/apply` as vllm-project/vllm had it at 04918f3e
    (`vllm/entrypoints/serve/fault_tolerance/api_router.py`): both keys required, `pause` or `retry`, a positive
    int timeout; the instruction runs before the answer — 200 `{"message": "Instruction executed successfully."}`,
    500 when it fails; FastAPI's `{"detail"}` for errors; no request id."""

    def __init__(self, succeeds: bool = True, takes_s: float = 0.0) -> None:
        self.succeeds, self.takes_s = succeeds, takes_s
        self.handled: list[tuple[str, int]] = []

    async def apply(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.text())
        except ValueError:
            return web.json_response({"detail": "Invalid JSON format"}, status=400)
        instruction = body.get("fault_tolerance_instruction")
        timeout = body.get("fault_tolerance_timeout")
        if instruction is None or timeout is None:
            return web.json_response({"detail": "Both 'fault_tolerance_instruction' and 'fault_tolerance_timeout' "
                                                "are required."}, status=400)  # fmt: skip
        if not isinstance(instruction, str):
            return web.json_response({"detail": "'fault_tolerance_instruction' must be a string."}, status=400)
        if instruction not in ("pause", "retry"):
            return web.json_response({"detail": "Invalid 'fault_tolerance_instruction' value."}, status=400)
        if not isinstance(timeout, int) or timeout <= 0:
            return web.json_response({"detail": "'fault_tolerance_timeout' must be a positive integer."}, status=400)
        self.handled.append((instruction, timeout))
        await asyncio.sleep(self.takes_s)
        if not self.succeeds:
            return web.json_response({"detail": "Failed to handle fault."}, status=500)
        return web.json_response({"message": "Instruction executed successfully."})


async def serve_earlier(router: EarlierRouter) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/fault_tolerance/apply", router.apply)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_apply_speaks_the_earlier_upstream_shape_too() -> None:
    router = EarlierRouter(takes_s=1.5)
    runner, url = await serve_earlier(router)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/fault_tolerance/apply", json={"instruction": "retry", "params": {}}) as r:
                assert r.status == 400, "the wheel's keys alone are refused there"
            # done before the answer (1.5 s), past the exchange's own 1 s: the instruction's timeout bounds it too
            assert await apply(session, url, "retry", timeout_s=1.0, instruction_timeout_s=20) == ""
            assert router.handled == [("retry", 20)]
            router.succeeds, router.takes_s = False, 0.0
            with pytest.raises(FtRejected, match=r"500 Failed to handle fault\."):
                await apply(session, url, "retry", instruction_timeout_s=20)
    finally:
        await runner.cleanup()


async def test_a_retry_accepted_without_an_id_is_judged_by_the_statuses() -> None:
    """The earlier shape's 200 carries no id: the attempt records the rank as having accepted, and the rule
    judges it by the statuses as ever (recovered when all are healthy, timed out past its deadline)."""
    decision = Instruct((0, 1), "retry", 10.0)
    attempt = attempt_for(decision, 100.0, {0: "", 1: ""})
    unhealthy = {r: RankStatus(r, "unhealthy", "RuntimeError") for r in (0, 1)}
    assert decide(situation(unhealthy, 105.0, attempt=attempt)).__class__.__name__ == "WaitRetry"
    healthy = {r: RankStatus(r, "healthy") for r in (0, 1)}
    assert decide(situation(healthy, 106.0, attempt=attempt)) == Recovered(attempt)
    assert decide(situation(unhealthy, 110.0, attempt=attempt)) == Escalate("retry timed out after 10 s")
