"""`nodeagentctl probe [master|slave]`: a drop-in for the guide's vllm_probe_yr.py, for monitoring systems that
run probe scripts themselves.

Same three checks, same messages, exit 0/1: the worker's liveness file (as yr_liveness_check.sh: contains
`liveness check success`, updated within 30 s), etcd health on the master (`etcd is ready: ADDR`), and a
2-token chat completion with non-empty content (`vLLM serve check success!`). Addresses come from the config
(the guide's scripts disagree on ports: 8080 vs 18020, 2379 vs 12379). Standard library only: it must stay
quick and must not depend on the agent running.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TextIO

from nodeagent.core.bindaddr import connect_host, direct_opener

GUIDE_LIVENESS_TIMEOUT_S = 30


class ProbeFailed(Exception):
    pass


def check_worker(path: Path, max_age_s: float = GUIDE_LIVENESS_TIMEOUT_S) -> str:
    if not path.exists():
        raise ProbeFailed(f"liveness probe file {path} not exists!")
    content = path.read_text(errors="replace")
    if "liveness check success" not in content:
        time.sleep(0.02)  # the worker rewrites it by truncate+write: an empty read is retried once
        content = path.read_text(errors="replace")
    if "liveness check success" not in content:
        raise ProbeFailed(f"liveness probe {path} check failed: {content.strip()}")
    age = time.time() - path.stat().st_mtime
    if age > max_age_s:
        raise ProbeFailed(f"liveness probe not update in {max_age_s:g}")
    return "yuanrong check success !"


def _opener() -> urllib.request.OpenerDirector:
    return direct_opener()  # never via a site proxy


def check_etcd(address: str, timeout: float = 5.0) -> str:
    try:
        with _opener().open(f"http://{address}/health", timeout=timeout) as resp:
            health = json.loads(resp.read() or b"{}").get("health")
    except (OSError, ValueError) as exc:
        raise ProbeFailed(f"etcd is not ready: {address} ({exc})") from None
    if health != "true":
        raise ProbeFailed(f"etcd is not ready: {address} (health={health!r})")
    return f"etcd is ready: {address}"


def check_vllm(url: str, model: str, timeout: float) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": False, "max_tokens": 2,
            "temperature": 0.6, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with _opener().open(req, timeout=timeout) as resp:
            text = resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise ProbeFailed(f"response error, status code: {exc.code}, text: {detail}") from None
    except OSError as exc:
        raise ProbeFailed(f"requests post failed, Exception: {exc}") from None
    try:
        content = json.loads(text)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ProbeFailed(f"json parse failed, text: {text[:300]}, Exception: {exc!r}") from None
    if not content:
        raise ProbeFailed("response content len is 0")
    return "vLLM serve check success!"


def probe_targets(config: Any) -> dict[str, Any]:
    """What to check on this node, derived from the agent config."""
    from nodeagent.config.model import DatasystemComponent, EtcdComponent, VllmComponent
    from nodeagent.render.launch import etcd_client_address

    comps = config.active_components().values()  # what this node runs (a worker runs no etcd)
    ds = next((c for c in comps if isinstance(c, DatasystemComponent)), None)
    etcd = next((c for c in comps if isinstance(c, EtcdComponent)), None)
    # The guide's master check posts to the service clients use: the PD proxy where this node runs one,
    # else the first vLLM that serves HTTP (a headless rank has no port).
    proxy = next((c for c in comps if getattr(c, "kind", None) == "proxy"), None)
    vllm = next((c for c in comps if isinstance(c, VllmComponent) and not c.headless), None)
    served = proxy if proxy is not None else vllm
    bind = getattr(served, "host", None)
    host = connect_host(bind)
    model = vllm.served_model_name if vllm else getattr(proxy, "served_model_name", None)
    return {
        "liveness": ds.liveness_check_path if ds else None,
        "etcd": etcd_client_address(config, etcd) if etcd else config.cluster.etcd_endpoints[0].removeprefix("http://"),
        "vllm_url": f"http://{host}:{served.port}/v1/chat/completions" if served is not None else None,
        "model": model,
    }


def run_probe(targets: dict[str, Any], role: str, timeout: float, out: TextIO = sys.stdout,
              err: TextIO = sys.stderr) -> int:
    try:
        if targets["liveness"] is None:
            raise ProbeFailed("no datasystem component in the config: no worker liveness file to check")
        print(check_worker(Path(targets["liveness"])), file=out)
        if role == "slave":
            return 0
        print(check_etcd(targets["etcd"]), file=out)
        if targets["vllm_url"] is None:
            raise ProbeFailed("no vllm component in the config")
        print(check_vllm(targets["vllm_url"], targets["model"], timeout), file=out)
    except ProbeFailed as exc:
        print(str(exc), file=err)
        return 1
    return 0
