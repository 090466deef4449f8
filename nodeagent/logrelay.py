"""Run a component and forward its output to journald as if the agent's unit had logged it.

Why: under systemd each component lives in a transient scope of its own (so an agent crash or watchdog restart
cannot take the stack down), and journald attributes a stdout stream's lines to the *writer's* cgroup — the
scope. Entries sent by root with `OBJECT_SYSTEMD_UNIT=dsv4-agent.service` are what `journalctl -u dsv4-agent`
matches, and `SYSLOG_IDENTIFIER=<component>` is what `-t <component>` matches. The relay lives inside the
scope with the component, so it survives the agent too; it exits with the component's exit status.

    python -m nodeagent.logrelay IDENTIFIER UNIT -- COMMAND ARGS...
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys

from nodeagent.journal import JournalSender

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
MAX_LINE = 64 * 1024


def relay(identifier: str, unit: str, command: list[str]) -> int:
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

    def emit(line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r")
        if text and not sender.send(text, 6, **fields):
            sys.stderr.write(text + "\n")  # journald gone: the scope's own stream still takes it

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
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or args[2] != "--":
        print("usage: python -m nodeagent.logrelay IDENTIFIER UNIT -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return relay(args[0], args[1], args[3:])


if __name__ == "__main__":
    sys.exit(main())
