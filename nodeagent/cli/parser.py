"""`nodeagentctl`'s command line: every command and option. Each command names its function as
"module:function" in `nodeagent.cli`, imported only when that command runs (`nodeagent.cli.main`)."""

from __future__ import annotations

import argparse
from typing import Any

from nodeagent.cli.common import DEFAULT_CONFIG, DEFAULT_UNIT, DEFAULT_WAIT_S
from nodeagent.core.parsing import fraction, positive_int, positive_number, positive_seconds


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    """run_vllm_bench.py's arguments (same names and defaults), then where the requests go (`benchcmd`)."""
    bench.add_argument("--total-len", type=positive_int, required=True, help="prompt tokens per request: prefix "
                       "+ suffix (the guide's table says input + output; its script makes it the prompt, as here)")
    bench.add_argument("--repeat-prefix-ratio", type=fraction, required=True,
                       help="share of the prompt that is a repeated prefix (0.9)")
    bench.add_argument("--output-len", type=positive_int, required=True, help="output tokens per request")
    bench.add_argument("--num-prompts", type=positive_int, required=True, help="requests in all")
    bench.add_argument("--num-prefixes", type=positive_int, required=True, help="distinct prefixes")
    bench.add_argument("--concurrency", type=positive_int, required=True, help="requests in flight at most")
    bench.add_argument("--output-dir", default=".", help="where both result JSONs go (default: .)")
    bench.add_argument("--seed", type=int, default=1000, help="random seed (default: 1000, the script's)")
    bench.add_argument("--request-rate", type=positive_number, default=None,
                       help="requests/s (default: unlimited)")
    bench.add_argument("--host", help="default: the PD proxy's if this node runs one, else this node's vLLM")
    bench.add_argument("--port", type=positive_int)
    bench.add_argument("--model", help="served model name (default: the config's served_model_name)")
    bench.add_argument("--tokenizer", help="default: the vllm component's model path")
    bench.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                       help="a vLLM /metrics whose prefix-cache counters count (repeatable; default: the target "
                            "vLLM, or every backend of the proxy)")
    bench.add_argument("--vllm", metavar="PATH", help="the vllm executable (default: `vllm` on PATH)")
    bench.add_argument("--json", action="store_true", help="print the saved JSON (vllm's own output to stderr)")


class _Unbuilt:
    """The parser of a command not on this command line: its arguments are not built (argparse's gettext lookups
    for ~25 subparsers cost ~10 ms of every command)."""

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_defaults(self, **kwargs: Any) -> None:
        pass


_TOP_OPTIONS_WITH_VALUE = ("--config", "-c", "--node")


def command_word(argv: list[str]) -> str | None:
    """The subcommand on a command line (None for help or none): the first word not an option or its value."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in _TOP_OPTIONS_WITH_VALUE:
            skip = True
        elif word in ("-h", "--help", "--"):
            return None
        elif not word.startswith("-"):
            return word
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command; `only`: build the arguments of that command alone (the others are listed, not built)."""
    parser = argparse.ArgumentParser(prog="nodeagentctl", description="Operate the dsv4-agent on this node.",
                                     epilog="exit codes: 0 ok, 1 action failed, 2 usage, 3 agent unreachable, "
                                     "4 unknown component, 5 unauthorised, 69 no vllm (bench), "
                                     "78 bad config")  # fmt: skip
    parser.add_argument("--config", "-c", default=None,
                        help=f"agent config (default: $DSV4_AGENT_CONFIG, then {DEFAULT_CONFIG}, then the agent "
                             "running on this host)")  # fmt: skip
    parser.add_argument("--node", metavar="NAME", help="act on another member of the cluster (status, render, "
                        "config validate, start, stop, restart); with several agents on this host, the one of that "
                        "node (also for cluster)")
    # --config is accepted after the subcommand too (`nodeagentctl status --config FILE`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="agent config")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, func: str) -> Any:
        if only is not None and name != only:
            return _Unbuilt()
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    status = add("status", "components: state, pid, ready, restarts, uptime, last exit", "status:cmd_status")
    status.add_argument("--json", action="store_true", help="the agent's full /status JSON")
    status.add_argument("--wide", "-w", action="store_true", help="LAST EXIT and NOTE whole, not cut with …")
    status.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME", help="another member's status")
    cluster = add("cluster", "every member as seen through etcd: state, versions, key age, consistency warnings",
                  "cluster:cmd_cluster")  # fmt: skip
    cluster.add_argument("cluster_action", nargs="?", default="list",
                         choices=["list", "pause", "resume", "redeploy", "restart", "rollout"],
                         help="list (default); pause|resume every agent's automatic actions; redeploy the whole "
                              "cluster; restart vllm [--group G]: a new generation of vLLM groups; rollout FILE: "
                              "change the groups one at a time to FILE (rollout status|pause|resume|abort|rollback)")
    cluster.add_argument("target", nargs="?", help="with restart: the component (vllm); with rollout: the new "
                         "file (installed on every member first) or status|pause|resume|abort|rollback")
    cluster.add_argument("--max-unavailable", type=int, help="with rollout: groups down at once at most (1)")
    cluster.add_argument("--order", help="with rollout: the kinds in order (prefill,decode)")
    cluster.add_argument("--canary", metavar="GROUP", help="with rollout: this group first, alone")
    cluster.add_argument("--bake", metavar="DURATION", help="with rollout: healthy this long before the next step "
                         "(10m; 90s, 1h)")
    cluster.add_argument("--bake-error-rate", metavar="RATE", help="with rollout: the bake fails when more of the "
                         "group's requests fail (5%%; 0.05 or 5%%)")
    cluster.add_argument("--bake-ttft-factor", metavar="X", help="with rollout: the bake fails when the group's mean "
                         "TTFT is more than X times the one before the step (2)")
    cluster.add_argument("--drain-timeout", metavar="DURATION", help="with rollout: drain at most this long (2m)")
    cluster.add_argument("--gate-timeout", metavar="DURATION", help="with rollout: restart to ready at most (90m)")
    cluster.add_argument("--allow-outage", metavar="KIND", action="append", help="with rollout: a kind with a "
                         "single group may go down for its step (prefill, decode, mixed; repeatable)")
    cluster.add_argument("--dry-run", action="store_true", help="with rollout: show the plan, store nothing")
    cluster.add_argument("--group", help="with restart: only this group")
    cluster.add_argument("--reason", help="with pause, redeploy or restart: recorded for the others (restart: in "
                         "the new generation's reason, shown in every rank's events)")
    cluster.add_argument("--no-drain", action="store_true", help="with restart: do not drain in-flight requests")
    cluster.add_argument("--json", action="store_true", help="the agent's full /cluster JSON")
    for action, text in (("start", "start a component (desired: running)"),
                         ("stop", "stop a component (desired: stopped; stays stopped)"),
                         ("restart", "restart a component; concurrent restarts coalesce")):  # fmt: skip
        p = add(action, text, "actions:cmd_component")
        p.set_defaults(action=action)
        p.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                       help="on another member (through etcd; a rank's restart restarts its group)")
        p.add_argument("component")
        p.add_argument("--wait", action="store_true", help="until done: up (new pid for restart) or stopped")
        if action != "start":
            p.add_argument("--no-drain", action="store_true",
                           help="do not wait for vLLM's in-flight requests (readiness off, then stop at once)")
        p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_WAIT_S, metavar="S",
                       help=f"with --wait (default {DEFAULT_WAIT_S:g})")  # fmt: skip
    redeploy = add("redeploy", "the guide's recovery: stop all, clean residue, start all in order",
                   "actions:cmd_redeploy")
    redeploy.add_argument("--reason", help="recorded in the event log")
    redeploy.add_argument("--wait", action="store_true", help="until every component is up again with a new pid")
    redeploy.add_argument("--timeout", type=positive_seconds, default=DEFAULT_WAIT_S, metavar="S")
    reset = add("reset", "clear restart counters (crash loop, backoff); without COMPONENT also the node's failed state",
                "actions:cmd_simple")  # fmt: skip
    reset.add_argument("component", nargs="?")
    add("uncordon", "take an isolated node back (chip resets did not help, or an NPU had to be separated)",
        "actions:cmd_simple")
    add("pause", "maintenance pause: no automatic restarts or redeploys", "actions:cmd_simple")
    add("resume", "end the maintenance pause", "actions:cmd_simple")
    add("detach", "the agent exits, leaving the stack running for the next agent to adopt", "actions:cmd_simple")
    add("reload", "re-read the config; restart only components whose command or environment changed",
        "actions:cmd_simple")
    pm = add("postmortem", "failure bundles: list, or show ID (log tail, process tree, command, probes, cores)",
             "node:cmd_postmortem")  # fmt: skip
    pm.add_argument("pm_command", nargs="?", choices=["list", "show"], default="list")
    pm.add_argument("bundle", nargs="?", help="with show: a bundle id (or a unique prefix)")
    pm.add_argument("-n", "--lines", type=_count, default=40, help="with show: last N lines of output (40)")
    pm.add_argument("--json", action="store_true")
    npu = add("npu", "NPU/RoCE health as the agent sees it; `npu override [N]` starts vLLM despite a fault",
              "node:cmd_npu")  # fmt: skip
    npu.add_argument("npu_command", nargs="?", choices=["status", "override"], default="status")
    npu.add_argument("npu", nargs="?", type=_count, help="with override: only this NPU's faults")
    npu.add_argument("--json", action="store_true")
    logs = add("logs", "a component's output (journald under systemd, else log_dir/COMPONENT.log)", "logs:cmd_logs")
    logs.add_argument("component")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("-n", "--lines", type=_count, default=50, metavar="N", help="last N lines (default 50)")
    logs.add_argument("--source", choices=["auto", "own", "journal", "file"], default="auto",
                      help="auto: the component's own log if it writes one (datasystem worker), else its output "
                           "where the agent sends it; own: only its own log")  # fmt: skip
    logs.add_argument("--unit", default=DEFAULT_UNIT, help=f"systemd unit for journalctl (default {DEFAULT_UNIT})")
    cache = add("cache", "vLLM prefix-cache hit rates, like watch_cache_hit_rate.sh", "tools:cmd_cache")
    if not isinstance(cache, _Unbuilt):
        from nodeagent.cli.cachewatch import add_cache_arguments

        add_cache_arguments(cache)
    bench = add("bench", "the guide's run_vllm_bench.py, plus the prefix-cache hit rates of that run",
                "tools:cmd_bench")
    _add_bench_arguments(bench)
    probe = add("probe", "the guide's vllm_probe_yr.py checks (exit 0/1)", "tools:cmd_probe")
    probe.add_argument("role", nargs="?", choices=["master", "slave"], help="default: from node.role")
    probe.add_argument("--timeout", type=positive_seconds, default=30.0, metavar="S")
    preflight = add("preflight", "check this host against the guide's requirements (exit 1 on any FAIL)",
                    "node:cmd_preflight")
    preflight.add_argument("--json", action="store_true", help="every check as JSON")
    preflight.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                           help="check this host as that member of a cluster file (default: node.name)")
    ports = add("ports", "every port this node binds: collisions, ephemeral-range exposure, the reserved-ports fix",
                "ports:cmd_ports")  # fmt: skip
    ports.add_argument("--apply", action="store_true", help="write net.ipv4.ip_local_reserved_ports (root), merged "
                       "with what is reserved, and print the sysctl.d line to keep it")  # fmt: skip
    ports.add_argument("--json", action="store_true")
    ports.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                       help="the ports of that member of a cluster file (default: node.name)")
    ports.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: a private sysctl tree
    shell = add("shell", "an interactive shell in the node's container (the guide's docker exec -it NAME bash)",
                "containercmd:cmd_shell")
    shell.add_argument("shell_command", nargs=argparse.REMAINDER, help="a command instead of bash")
    render = add("render", "print the exact command, environment and cwd of components", "configcmd:cmd_render")
    render.add_argument("component", nargs="?")
    render.add_argument("--json", action="store_true")
    render.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                        help="render this member of a cluster file (default: node.name)")
    render.add_argument("--root", default="/", help=argparse.SUPPRESS)  # tests: a fixture host for `container`
    if only in (None, "config"):
        config = sub.add_parser("config", help="config tools")
        config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
        validate = config_sub.add_parser("validate", help="validate a config file")
        validate.add_argument("file")
        validate.add_argument("--node", default=argparse.SUPPRESS, metavar="NAME",
                              help="validate as this member of a cluster file")
        validate.set_defaults(func="configcmd:cmd_config_validate")
    if only in (None, "version"):
        sub.add_parser("version", help="print the version").set_defaults(func="version")
    if only is not None and only not in sub.choices:  # not a command: argparse's error lists them all
        return build_parser()
    return parser

