"""Run a component and forward its output to journald as if the agent's unit had logged it.

Why: under systemd each component lives in a transient scope of its own (so an agent crash or watchdog restart
cannot take the stack down), and journald attributes a stdout stream's lines to the *writer's* cgroup — the
scope. Entries sent by root with `OBJECT_SYSTEMD_UNIT=dsv4-agent.service` are what `journalctl -u dsv4-agent`
matches, and `SYSLOG_IDENTIFIER=<component>` is what `-t <component>` matches. The relay lives inside the
scope with the component, so it survives the agent too; it exits with the component's exit status.

    python -m nodeagent.node.logrelay IDENTIFIER UNIT [--tail FILE] [--kv FILE] [--phases FILE] -- COMMAND ARGS...

`--tail FILE` keeps the component's last lines in FILE when it exits, so the agent can say why a start failed
without querying journald on the crash path. `--kv FILE` appends every KV transfer failure line
(`kvtimeouts.parse_transfer_failure`: Mooncake's) to FILE as it passes, for `kvlog` to count per pair — the same
lines it reads from the log file outside systemd; FILE starts afresh past `KV_KEEP_BYTES` (the reader sees it
shrink and reads from its start). `--phases FILE` appends the lines of a vLLM start (`start_phases.start_line`,
the first vLLM-shaped line, the first completion answered) for `layers.start_phases`: bounded, a start's few lines.
"""

from __future__ import annotations

import collections
import os
import selectors
import signal
import subprocess
import sys

from nodeagent.core.journal import JournalSender
from nodeagent.vllm.kv_transfer import parse_transfer_failure
from nodeagent.vllm.start_phases import phase_of_line, start_line, vllm_shaped

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_LINE = 64 * 1024


TAIL_KEEP = 20
KV_KEEP_BYTES = 1 << 20


def relay(identifier: str, unit: str, command: list[str], tail_file: str | None = None,
          kv_file: str | None = None, phase_file: str | None = None) -> int:  # fmt: skip
    """Run `command` for life, its output to the journal. Not `core.run`: the child is the component itself, it
    keeps the relay's session (the agent stops that whole tree) and gets every signal the relay gets."""
    read_fd, write_fd = os.pipe()
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, close_fds=True)
    except OSError as exc:
        print(f"logrelay: cannot start {command[0]}: {exc}", file=sys.stderr)
        return 127
    finally:
        os.close(write_fd)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    sender = JournalSender()
    fields = {"SYSLOG_IDENTIFIER": identifier, "OBJECT_SYSTEMD_UNIT": unit, "COMPONENT": identifier,
              "OBJECT_PID": child.pid}  # fmt: skip

    recent: collections.deque[str] = collections.deque(maxlen=TAIL_KEEP)
    kept = {"shaped": False, "first_token": False}

    def emit(line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r")
        if text:
            recent.append(text)
        if text and not sender.send(text, 6, **fields):
            sys.stderr.write(text + "\n")  # journald gone: the scope's own stream still takes it
        if kv_file and text and parse_transfer_failure(text) is not None:
            keep_kv_line(kv_file, text)
        if phase_file and text and keeps_phase_line(text, kept):
            keep_kv_line(phase_file, text)

    pidfd = os.pidfd_open(child.pid)
    selector = selectors.DefaultSelector()
    selector.register(read_fd, selectors.EVENT_READ, "out")
    selector.register(pidfd, selectors.EVENT_READ, "exit")
    pending = b""
    exited = eof = False
    # Descendants (vLLM's EngineCore) inherit the pipe, so EOF may never come: the child's exit ends the relay
    # once its last output is drained (no data for 0.2 s).
    while not (exited and eof):
        events = selector.select(timeout=0.2 if exited else None)
        if exited and not events:
            break
        for key, _ in events:
            if key.data == "exit":
                selector.unregister(pidfd)
                exited = True
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                selector.unregister(read_fd)
                eof = True
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                emit(line)
            if len(pending) > MAX_LINE:
                emit(pending)
                pending = b""
        if eof and not exited:
            child.wait()
            exited = True
    if pending:
        emit(pending)
    code = child.wait()
    if tail_file:
        write_tail(tail_file, list(recent))
    return 128 - code if code < 0 else code


def keeps_phase_line(text: str, kept: dict[str, bool]) -> bool:
    """A start's line, the first vLLM-shaped one, and only the first completion answered (not every request's)."""
    hit = phase_of_line(text)
    if hit is not None and hit[0] == "first_token":
        if kept["first_token"]:
            return False
        kept["first_token"] = True
        return True
    if not kept["shaped"] and vllm_shaped(text):
        kept["shaped"] = True
        return True
    return start_line(text)


def keep_kv_line(path: str, text: str) -> None:
    try:
        with open(path, "ab") as fh:
            if fh.tell() > KV_KEEP_BYTES:
                fh.truncate(0)
            fh.write(text.encode(errors="replace") + b"\n")
    except OSError:
        pass


def write_tail(path: str, lines: list[str]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    files: dict[str, str] = {}
    while len(args) >= 4 and args[2] in ("--tail", "--kv", "--phases"):
        files[args[2]], args = args[3], args[:2] + args[4:]
    if len(args) < 4 or args[2] != "--":
        print("usage: python -m nodeagent.node.logrelay IDENTIFIER UNIT [--tail FILE] [--kv FILE] [--phases FILE] -- "
              "COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return relay(args[0], args[1], args[3:], files.get("--tail"), files.get("--kv"), files.get("--phases"))


if __name__ == "__main__":
    sys.exit(main())
