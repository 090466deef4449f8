"""Child output files: copytruncate rotation keeps a writer's O_APPEND fd valid and keeps the last N files."""

from __future__ import annotations

import os
from pathlib import Path

from nodeagent.logsink import log_path, open_output, rotate_if_large


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
