"""The OpenAPI 3 document of the agent's HTTP API, served at GET /openapi.json.

Written out by hand (the API is small) and checked against the router by the tests, so a new endpoint
without documentation fails the suite.
"""

from __future__ import annotations

from typing import Any

from nodeagent import __version__
from nodeagent.core.states import Desired, State

_ERROR = {"$ref": "#/components/responses/Error"}
_AUTH_ERRORS = {"401": _ERROR, "503": _ERROR}
_COMPONENT_NAME = {
    "name": "name", "in": "path", "required": True, "schema": {"type": "string"},
    "description": "A component of this node (e.g. etcd, datasystem, vllm)",
}  # fmt: skip


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(media: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": {"type": "string"}}}}


def _get(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"get": {"summary": summary, "operationId": extra.pop("operation_id"), "responses": responses, **extra}}


def _post(summary: str, operation_id: str, responses: dict[str, Any], body: dict[str, Any] | None = None,
          parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    op: dict[str, Any] = {
        "summary": summary, "operationId": operation_id, "security": [{"bearer": []}],
        "responses": {**responses, **_AUTH_ERRORS, "400": _ERROR, "413": _ERROR},
    }  # fmt: skip
    if parameters:
        op["parameters"] = parameters
    schema = body or {"type": "object", "additionalProperties": False}
    op["requestBody"] = {"required": False, "content": {"application/json": {"schema": schema}}}
    return {"post": op}


_ACCEPTED = _json({"$ref": "#/components/schemas/Accepted"}, "Accepted; runs in the background")
_OK = _json({"$ref": "#/components/schemas/Ok"}, "Done")


def openapi_document() -> dict[str, Any]:
    schemas = {
        "Error": {
            "type": "object", "required": ["error", "status"],
            "properties": {"error": {"type": "string"}, "status": {"type": "integer"}},
        },
        "Accepted": {
            "type": "object", "required": ["accepted", "action"],
            "properties": {"accepted": {"type": "boolean"}, "action": {"type": "string"},
                           "component": {"type": "string", "nullable": True},
                           "already_in_progress": {"type": "boolean"}},
        },
        "Ok": {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"},
                                                                    "action": {"type": "string"}}},
        "ComponentStatus": {
            "type": "object",
            "properties": {
                "kind": {"type": "string"},
                "state": {"type": "string", "enum": [str(s) for s in State]},
                "desired": {"type": "string", "enum": [str(d) for d in Desired]},
                "pid": {"type": "integer", "nullable": True},
                "ready": {"type": "boolean"}, "up": {"type": "boolean"},
                "restarts": {"type": "integer"},
                "uptime_s": {"type": "number", "nullable": True},
                "last_exit": {"type": "object", "nullable": True},
                "backoff_remaining_s": {"type": "number", "nullable": True},
                "held": {"type": "string", "nullable": True},
                "failure": {"type": "object", "nullable": True,
                            "description": "When failed: what, detail, permanent reason, the last output lines"},
                "ready_blockers": {"type": "object", "description": "Reasons besides its probes it is not ready"},
                "draining": {"type": "object", "description": "While draining: requests running/waiting, time left"},
                "probes": {"type": "object", "description": "Per role: status and each probe's last result"},
                "policy": {"type": "object", "description": "Restart policy counters (crash loop, backoff)"},
            },
        },
        "CacheHistory": {
            "type": "object",
            "properties": {
                "now": {"type": "number"}, "period_s": {"type": "number"}, "history_s": {"type": "number"},
                "started_at": {"type": "number", "description": "When this history began (a new agent: a new one)"},
                "components": {"type": "array", "items": {"type": "string"}},
                "last_scrape_at": {"type": "number", "nullable": True},
                "scrape_ok": {"type": "object", "additionalProperties": {"type": "boolean"}},
                "latest": {"type": "object", "description": "Component → rows as `nodeagentctl cache --json`"},
                "samples": {"type": "array", "items": {"type": "object", "properties": {
                    "ts": {"type": "number"},
                    "components": {"type": "object", "description": "Component → local_win, local_total, ext_win, "
                                   "ext_total, eff_total (0..1 or null), queries, reset"}}}},
            },
        },
        "Status": {
            "type": "object",
            "properties": {
                "node": {"type": "object"}, "paused": {"type": "boolean"}, "redeploying": {"type": "boolean"},
                "node_policy": {"type": "object"}, "agent": {"type": "object"},
                "components": {"type": "object",
                               "additionalProperties": {"$ref": "#/components/schemas/ComponentStatus"}},
                "mqtt": {"type": "object", "description": "Only with agent.mqtt: connected, broker, last_error, "
                         "queued, dropped, published, topics"},
                "caches": {"type": "object", "description": "The vLLM ranks' compile caches on the host (agent.caches):"
                           " enabled, dir, keep, max_bytes, bytes, measured_at, keys (key, bytes, last_used, "
                           "used_by), unkeyed (component → why none), removed, error"},
            },
        },
    }  # fmt: skip
    paths: dict[str, Any] = {
        "/healthz": _get("The agent is alive", {"200": _json({"type": "object"}, "Alive")}, operation_id="healthz"),
        "/livez": _get(
            "The guide's liveness: vllm, datasystem and (on the master) etcd running with liveness probes passing",
            {"200": _json({"type": "object"}, "Live"), "503": _json({"type": "object"}, "Not live: see failing")},
            operation_id="livez",
        ),
        "/readyz": _get(
            "vLLM ready (on a node without vLLM: every component ready)",
            {"200": _json({"type": "object"}, "Ready"), "503": _json({"type": "object"}, "Not ready")},
            operation_id="readyz",
        ),
        "/status": _get("Node, agent and per-component state, PIDs, restarts, probes, desired state",
                        {"200": _json({"$ref": "#/components/schemas/Status"}, "Status")}, operation_id="status"),
        "/cluster": _get(
            "The cluster as this node sees it through etcd: every member of the cluster file (present or not) and "
            "any unknown one, each with its record and key age; etcd's connection state; consistency warnings",
            {"200": _json({"type": "object"}, "Cluster view"), "404": _ERROR},
            operation_id="cluster",
        ),
        "/metrics": _get(
            "Prometheus metrics: components, probes, process usage, vLLM prefix-cache hit ratios",
            {"200": _text("text/plain", "Prometheus text format 0.0.4")},
            operation_id="metrics",
        ),
        "/events": _get(
            "Server-sent events: recent ones replayed, a `: live` comment, then live ones (data: one JSON event each)",
            {"200": _text("text/event-stream", "An event stream"), "400": _ERROR, "503": _ERROR},
            operation_id="events",
            parameters=[
                {"name": "replay", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 0, "default": 50},
                 "description": "How many recent events to send first (bounded by the agent's buffer)"},
                {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer"},
                 "description": "Resume: replay the buffered events after this id instead"},
            ],
        ),
        "/ui": _get("The status page (HTML; its script and style come from /ui/{asset}; 404 when agent.ui.enabled "
                    "is false)", {"200": _text("text/html", "The page"), "404": _ERROR}, operation_id="ui_page"),
        "/ui/{asset}": _get(
            "A static file of the status page, served from the package", {
                "200": {"description": "The file", "content": {"text/javascript": {"schema": {"type": "string"}},
                                                               "text/css": {"schema": {"type": "string"}}}},
                "404": _ERROR},
            operation_id="ui_asset",
            parameters=[{"name": "asset", "in": "path", "required": True, "schema": {"type": "string"},
                         "description": "A file name such as ui.js"}],
        ),
        "/cache": _get(
            "vLLM prefix-cache hit rates over the last agent.ui.cache_history_s: one sample per "
            "agent.ui.cache_period_s scrape, each vLLM component's `all` row (local/ext _win and _total, eff_total; "
            "null = undefined), plus the latest per-engine table",
            {"200": _json({"$ref": "#/components/schemas/CacheHistory"}, "History"), "400": _ERROR, "404": _ERROR},
            operation_id="cache_history",
            parameters=[{"name": "since", "in": "query", "required": False, "schema": {"type": "number"},
                         "description": "Only samples taken after this Unix time"}],
        ),
        "/openapi.json": _get("This document", {"200": _json({"type": "object"}, "OpenAPI 3 document")},
                              operation_id="openapi"),
        "/components/{name}/{action}": _post(
            "Start, stop or restart a component (sets its desired state); concurrent restarts coalesce; a vLLM "
            "restart or stop drains in-flight requests first unless drain is false",
            "component_action", {"202": _ACCEPTED, "404": _ERROR},
            body={"type": "object", "additionalProperties": False, "properties": {"drain": {"type": "boolean"}}},
            parameters=[_COMPONENT_NAME, {"name": "action", "in": "path", "required": True,
                                          "schema": {"type": "string", "enum": ["start", "stop", "restart"]}}],
        ),
        "/cluster/pause": _post(
            "Maintenance pause for every agent of the cluster (no automatic restart, gang restart or redeploy)",
            "cluster_pause", {"200": _OK, "404": _ERROR},
            body={"type": "object", "additionalProperties": False, "properties": {"reason": {"type": "string"}}},
        ),
        "/cluster/resume": _post("End the cluster-wide pause", "cluster_resume", {"200": _OK, "404": _ERROR}),
        "/cluster/redeploy": _post(
            "Redeploy the whole cluster: every node stops vLLM then its worker, etcd's data is archived and wiped, "
            "everything starts in order through the barriers (once, however many ask)",
            "cluster_redeploy", {"202": _ACCEPTED, "404": _ERROR},
            body={"type": "object", "additionalProperties": False,
                  "properties": {"reason": {"type": "string", "maxLength": 500}}},
        ),
        "/cluster/restart": _post(
            "A new generation of vLLM groups (one with `group`, else all): every rank restarts once, drained",
            "cluster_restart", {"202": _ACCEPTED, "404": _ERROR},
            body={"type": "object", "additionalProperties": False,
                  "properties": {"component": {"type": "string", "enum": ["vllm"]}, "group": {"type": "string"},
                                 "drain": {"type": "boolean"}}},
        ),
        "/cluster/nodes/{node}/components/{name}/{action}": _post(
            "Start, stop or restart a component of another node, through etcd; its agent's answer",
            "cluster_node_action", {"200": _json({"type": "object"}, "The target's answer"), "404": _ERROR,
                                    "409": _ERROR},
            body={"type": "object", "additionalProperties": False, "properties": {"drain": {"type": "boolean"}}},
            parameters=[{"name": "node", "in": "path", "required": True, "schema": {"type": "string"}},
                        _COMPONENT_NAME, {"name": "action", "in": "path", "required": True,
                                          "schema": {"type": "string", "enum": ["start", "stop", "restart"]}}],
        ),
        "/cluster/rollout": _post(
            "Plan a rolling change to this node's new cluster file (`file`, default: the one it was started with): "
            "which groups change and why, the steps under the capacity floor; stored in etcd and carried out unless "
            "dry_run (202), else the plan alone (200)",
            "cluster_rollout", {"200": _json({"type": "object"}, "The plan"), "202": _ACCEPTED, "400": _ERROR,
                                "404": _ERROR, "409": _ERROR},
            body={"type": "object", "additionalProperties": False, "properties": {
                "file": {"type": "string"}, "dry_run": {"type": "boolean"},
                "max_unavailable": {"type": "integer", "minimum": 1}, "order": {"type": "string"},
                "canary": {"type": "string"}, "bake_s": {"type": "number", "minimum": 0},
                "allow_outage": {"type": "array", "items": {"type": "string"}},
                "drain_timeout_s": {"type": "number", "minimum": 0},
                "gate_timeout_s": {"type": "number", "minimum": 0},
                "bake_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "bake_ttft_factor": {"type": "number", "minimum": 1}}},
        ),
        "/cluster/rollout/{action}": _post(
            "Pause (the step in progress finishes), resume (a halted rollout retries its failed step), abort (no "
            "further step) or roll back (the steps done, in reverse) the rollout in etcd",
            "cluster_rollout_action", {"200": _OK, "404": _ERROR, "409": _ERROR},
            parameters=[{"name": "action", "in": "path", "required": True,
                         "schema": {"type": "string", "enum": ["pause", "resume", "abort", "rollback"]}}],
        ),
        "/preflight": _get("The agent's last preflight report and what it holds",
                           {"200": _json({"type": "object"}, "Report"), "404": _ERROR}, operation_id="preflight"),
        "/npu/override": _post(
            "Start vLLM despite the NPU faults holding it now (of one NPU, or all)", "npu_override", {"200": _OK},
            body={"type": "object", "additionalProperties": False,
                  "properties": {"npu": {"type": "integer", "minimum": 0}}},
        ),
        "/uncordon": _post(
            "Take an isolated node back: isolation ends, the chip-reset budget starts afresh, the NPU users start",
            "uncordon", {"200": _OK, "409": _ERROR},
        ),
        "/redeploy": _post(
            "The guide's node recovery: stop all in reverse order, clean residue, start all in order",
            "redeploy", {"202": _ACCEPTED},
            body={"type": "object", "additionalProperties": False,
                  "properties": {"reason": {"type": "string", "maxLength": 500}}},
        ),
        "/reset": _post(
            "Reset restart-policy counters (crash loop, backoff) of one component, or all and the node's failed state",
            "reset", {"200": _OK, "404": _ERROR},
            body={"type": "object", "additionalProperties": False, "properties": {"component": {"type": "string"}}},
        ),
        "/pause": _post("Maintenance pause: no automatic restarts or redeploys", "pause", {"200": _OK}),
        "/resume": _post("End the maintenance pause", "resume", {"200": _OK}),
        "/detach": _post("The agent exits leaving the stack running, for the next agent to adopt", "detach",
                         {"202": _ACCEPTED}),
        "/reload": _post(
            "Re-read the config file; restart only components whose command or environment changed",
            "reload", {"200": _json({"type": "object", "properties": {
                "ok": {"type": "boolean"}, "restarted": {"type": "array", "items": {"type": "string"}},
                "started": {"type": "array", "items": {"type": "string"}},
                "unchanged": {"type": "array", "items": {"type": "string"}}}}, "Reloaded")},
        ),
    }  # fmt: skip
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "dsv4-agent",
            "version": __version__,
            "description": "Local API of the per-node DeepSeek-V4 supervisor. Reads are open; POSTs need "
            "'Authorization: Bearer <token>' (agent.api.token_file), or the unix socket as root or the "
            "agent's user. Errors are JSON {error, status}.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": {"Error": _json({"$ref": "#/components/schemas/Error"}, "Error")},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
