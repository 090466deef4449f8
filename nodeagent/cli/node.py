"""`nodeagentctl preflight`, `npu` and `postmortem`: this host against the guide's requirements, NPU health as
the agent sees it, and the failure bundles on disk."""

from __future__ import annotations

import argparse
import json
import time

from nodeagent.cli.agentconfig import Client, connect, full_config, light_config
from nodeagent.cli.common import EXIT_FAILED, EXIT_UNKNOWN, EXIT_USAGE, CliError


def cmd_preflight(args: argparse.Namespace) -> int:
    from nodeagent.layers.preflight import run_preflight

    config = full_config(args, getattr(args, "node", None))
    peers = None
    if config.cluster.nodes:  # peers as the running agent sees them through etcd (none when it is not running)
        from nodeagent.cluster.consistency import preflight_peers

        try:
            status, view = Client(light_config(args), timeout=3.0).request("GET", "/cluster")
        except CliError:
            status, view = 0, None
        if status == 200 and isinstance(view, dict):
            peers = preflight_peers(view, time.time())
    report = run_preflight(config, peers=peers)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return EXIT_FAILED if report.failed else 0



def cmd_npu(args: argparse.Namespace) -> int:
    """NPU health as the agent sees it, or an override of the faults holding vLLM."""
    client = connect(args)
    if args.npu_command == "override":
        answer = client.post("/npu/override", {} if args.npu is None else {"npu": args.npu})
        done = answer.get("overridden") or []
        if not done:
            print("npu override: no fault was holding vLLM" + (f" on npu {args.npu}" if args.npu is not None else ""))
        for fault in done:
            print(f"npu override: {fault.get('message')}")
        return 0
    npu = client.get("/status").get("npu") or {}
    if args.json:
        print(json.dumps(npu, indent=2))
        return 0
    if not npu.get("checked"):
        print(f"NPU health not checked: {npu.get('skipped')}")
        return 0
    start = npu.get("start") or {}
    print("vLLM may start" if start.get("allowed") else "vLLM start HELD: " + "; ".join(start.get("reasons") or []))
    for chip in npu.get("npus") or []:
        print(f"npu {chip['npu']} chip {chip['chip']} {chip['name']}: health {chip['health']}, HBM "
              f"{chip['hbm_used_mb']}/{chip['hbm_total_mb']} MB, link {chip.get('link') or '-'}")
    for fault in npu.get("faults") or []:
        flag = ", overridden" if fault.get("overridden") else ""
        print(f"fault: {fault.get('message')} ({fault.get('level')}{flag})")
    return 0


def cmd_postmortem(args: argparse.Namespace) -> int:
    """The failure bundles under state_dir/postmortem (read from disk: works while the agent is down)."""
    from nodeagent.core.postmortem import list_bundles, read_bundle

    root = light_config(args).state_dir / "postmortem"
    if args.pm_command == "show":
        if not args.bundle:
            raise CliError("postmortem show needs a bundle id (nodeagentctl postmortem list)", EXIT_USAGE)
        try:
            manifest, output = read_bundle(root, args.bundle)
        except KeyError as exc:
            raise CliError(str(exc.args[0]), EXIT_UNKNOWN) from None
        if args.json:
            print(json.dumps({**manifest, "output": output}, indent=2, default=str))
            return 0
        failure = manifest.get("failure") or {}
        print(f"{manifest['component']} ({manifest['kind']}) failed {time.ctime(manifest['at'])}: "
              f"{failure.get('permanent') or failure.get('detail')}")
        if manifest.get("start_phase"):
            phase = manifest["start_phase"]
            print(f"start died in: {phase.get('died_in')} (reached {phase.get('reached') or 'nothing'}; "
                  f"phases {phase.get('seconds')})")
        for step in manifest.get("ladder") or []:
            print(f"ladder: {step.get('rung')} {step.get('outcome')}: {step.get('detail')}")
        print(f"next: {manifest.get('decision')}")
        print(f"command: {' '.join((manifest.get('command') or {}).get('argv') or [])[:300]}")
        for proc in manifest.get("tree") or []:
            print(f"  pid {proc.get('pid')} ({proc.get('status', '?')}): {proc.get('cmdline', '')[:120]}")
        for name, size in (manifest.get("cores") or {}).items():
            print(f"core dump: {name} ({size} bytes)")
        print(f"files: {', '.join(manifest.get('files') or [])}")
        print("--- last output ---")
        print("\n".join(output.splitlines()[-args.lines:]))
        return 0
    bundles = list_bundles(root)
    if args.json:
        print(json.dumps(bundles, indent=2))
        return 0
    if not bundles:
        print(f"no post-mortems in {root}")
    for b in bundles:
        print(f"{b['id']}  {b['component']:<12} {b['bytes'] / 1024:8.1f} KiB  {b['path']}")
    return 0

