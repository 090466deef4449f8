"""Child output files: copytruncate rotation keeps a writer's O_APPEND fd valid and keeps the last N files."""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.core.logsink import log_path, open_output, rotate_if_large


def test_copytruncate_rotation_keeps_the_writer_working(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    fd, where = open_output("vllm", tmp_path)
    path = log_path(tmp_path, "vllm")
    assert where == str(path)
    try:
        for generation in range(4):
            os.write(fd, f"run {generation} ".encode() * 100)
            assert rotate_if_large(path, max_bytes=100, keep=2)
        os.write(fd, b"after rotation\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"after rotation\n", "the writer's O_APPEND fd continues at the start"
    assert (path.with_name("vllm.log.1").read_bytes()).startswith(b"run 3 ")
    assert (path.with_name("vllm.log.2").read_bytes()).startswith(b"run 2 ")
    assert not path.with_name("vllm.log.3").exists(), "only `keep` rotated files survive"
    assert not rotate_if_large(path, max_bytes=100, keep=2), "a small file is left alone"


async def test_under_journald_a_component_runs_through_the_relay_with_or_without_a_scope(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Without a scope too (agent.systemd_scopes: never under systemd): the relay is what keeps the lines the agent
    reads itself (the last ones, the KV transfer failures). No journald here: its stream falls back to a file,
    the relay's sends to its stderr (that file)."""
    import sys

    from nodeagent.core import logsink
    from nodeagent.node import launcher
    from nodeagent.render.launch import LaunchSpec

    monkeypatch.setattr(logsink, "use_journal", lambda: True)
    failure = "E20260101 transfer failed and disconnect to:10.0.0.2:20002"
    spec = LaunchSpec("vllm", "vllm", (sys.executable, "-c", f"print('up'); print({failure!r})"), {}, (),
                      tmp_path / "cwd")  # fmt: skip
    folder = tmp_path / "components" / "vllm"
    launched = await launcher.launch(spec, tmp_path / "logs", dict(os.environ), folder, 30, None, folder / "tail")
    assert launched.popen is not None
    assert launched.popen.wait(30) == 0
    assert "nodeagent.node.logrelay" in launched.popen.args
    assert (folder / logsink.KV_FAILURES).read_text() == failure + "\n"
    assert (folder / "tail").read_text().splitlines() == ["up", failure]
    assert failure in log_path(tmp_path / "logs", "vllm").read_text(), "journald gone: the relay's stderr has it"
