"""The pure parts of MQTT publishing, without a broker: config validation, topics, payloads, the outbox's drop
accounting, backoff, the persisted event sequence number, and the CLI's MQTT line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nodeagent.api.mqtt_model import (
    Outbox,
    cache_payload,
    cache_summary,
    default_client_id,
    drop_message,
    explain_connect_error,
    offline_payload,
    reconnect_delay,
    status_digest,
    status_payload,
    topics_for,
)
from nodeagent.cli import format_mqtt, format_status
from nodeagent.config.load import parse_config
from nodeagent.core.errors import ConfigError
from nodeagent.core.events import SEQ_JUMP_AFTER_CRASH, Event, EventBus, SavedSeq, SeqFile, resume_seq
from nodeagent.vllm.cachehit import CacheCounters, compute_table


def config_error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "node.yaml")
    return str(info.value)


@pytest.mark.parametrize(("yaml_text", "message"), [
    ("agent:\n  mqtt:\n    url: http://broker\n", "node.yaml:3: agent.mqtt.url: must be mqtt://HOST[:PORT] or mqtts"),
    ("agent:\n  mqtt:\n    url: mqtt://u:p@broker\n", "node.yaml:3: agent.mqtt.url: no credentials in the URL"),
    ("agent:\n  mqtt:\n    url: mqtt://broker:99999\n", "node.yaml:3: agent.mqtt.url: not a broker URL"),
    ("agent:\n  mqtt:\n    url: mqtt://broker/x\n", "node.yaml:3: agent.mqtt.url: nothing may follow HOST:PORT"),
    ("agent:\n  mqtt: {url: 'mqtt://b', password_file: /p}\n", "node.yaml:2: agent.mqtt.password_file: a password "
     "needs a username"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    ca_file: /ca.pem\n", "node.yaml:4: agent.mqtt.ca_file: a CA file is for "
     "TLS: use an mqtts:// url"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    topic_prefix: a/+/b\n", "node.yaml:4: agent.mqtt.topic_prefix: must be "
     "topic levels"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    topic_prefix: /a\n", "node.yaml:4: agent.mqtt.topic_prefix:"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    qos: 3\n", "node.yaml:4: agent.mqtt.qos:"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    buffer: 5\n", "node.yaml:4: agent.mqtt.buffer:"),
    ("agent:\n  mqtt:\n    url: mqtt://b\n    client-id: x\n", "node.yaml:4: agent.mqtt.client-id: unknown key "
     "'client-id' (did you mean 'client_id'?)"),
    ("agent:\n  mqtt: {}\n", "node.yaml:2: agent.mqtt.url: Field required"),
    ("cluster:\n  name: a/b\n", "node.yaml:2: cluster.name: must not contain '/'"),
    ("node:\n  name: 'n#1'\n", "node.yaml:2: node.name: must not contain '#'"),
])  # fmt: skip
def test_bad_mqtt_config_names_file_line_and_key(yaml_text: str, message: str) -> None:
    assert message in config_error(yaml_text)


def test_mqtt_config_defaults_and_url_parts() -> None:
    assert parse_config("{}").agent.mqtt is None
    cfg = parse_config("agent: {mqtt: {url: 'mqtt://broker'}}").agent.mqtt
    assert cfg is not None and (cfg.host, cfg.port, cfg.tls, cfg.qos, cfg.topic_prefix) == ("broker", 1883, False, 1,
                                                                                            "dsv4")  # fmt: skip
    tls = parse_config("agent: {mqtt: {url: 'mqtts://[::1]', username: u, password_file: pw, ca_file: ca.pem}}",
                       "x.yaml", base_dir=Path("/etc/dsv4-agent")).agent.mqtt  # fmt: skip
    assert tls is not None and (tls.host, tls.port, tls.tls) == ("::1", 8883, True)
    assert tls.password_file == Path("/etc/dsv4-agent/pw") and tls.ca_file == Path("/etc/dsv4-agent/ca.pem")


def test_topics_and_client_id() -> None:
    t = topics_for("site/dsv4", "prod", "node3")
    assert (t.status, t.events, t.cache) == ("site/dsv4/prod/node3/status", "site/dsv4/prod/node3/events",
                                             "site/dsv4/prod/node3/cache")  # fmt: skip
    assert default_client_id("prod", "node3") == "dsv4-agent-prod-node3"


def ev(seq: int) -> Event:
    return Event(seq, 0.0, "x", f"event {seq}")


def test_outbox_keeps_order_and_counts_what_overflow_drops() -> None:
    box = Outbox(limit=10)
    for seq in range(1, 26):
        box.push(ev(seq))
    assert [e.seq for e in box.items] == list(range(16, 26)) and box.dropped == 15
    report = box.take_report()
    assert report == {"dropped": 15, "first_seq": 1, "last_seq": 15, "dropped_total": 15, "buffer": 10}
    assert "15 events (seq 1-15) were dropped" in drop_message(report) and box.take_report() is None
    sent = box.send(3)
    assert [e.seq for e in sent] == [16, 17, 18]
    box.acked()
    assert [e.seq for e in box.items][:1] == [19] and len(box) == 7


def test_outbox_never_drops_what_is_on_the_wire() -> None:
    box = Outbox(limit=10)
    for seq in range(1, 11):
        box.push(ev(seq))
    assert [e.seq for e in box.send(3)] == [1, 2, 3]
    box.push(ev(11))  # full: the oldest *not* in flight goes
    assert [e.seq for e in box.items] == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    box.failed()  # not acknowledged: sent again, from the same place
    assert [e.seq for e in box.send(8)][:4] == [1, 2, 3, 5]
    box.acked()
    assert [e.seq for e in box.items] == [10, 11]
    assert box.take_report() == {"dropped": 1, "first_seq": 4, "last_seq": 4, "dropped_total": 1, "buffer": 10}


def test_outbox_counts_a_gap_in_the_numbers_it_is_given() -> None:
    """The bus drops a slow subscriber's oldest events; the outbox sees that as missing numbers."""
    box = Outbox(limit=100)
    for seq in (5, 6, 9, 10):
        box.push(ev(seq))
    assert box.dropped == 2 and box.take_report() == {"dropped": 2, "first_seq": 7, "last_seq": 8,
                                                      "dropped_total": 2, "buffer": 100}  # fmt: skip


def test_reconnect_backoff_doubles_to_the_cap() -> None:
    assert [reconnect_delay(n, 30) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_refused_credentials_get_a_hint() -> None:
    assert "check agent.mqtt.username and password_file" in explain_connect_error(134, "Bad user name or password")
    assert "check agent.mqtt.username" in explain_connect_error(5, "Not authorised")
    assert explain_connect_error(None, "[Errno 111] Connection refused") == "cannot connect: [Errno 111] Connection " \
                                                                            "refused"


SUP_STATUS = {
    "node": {"name": "n1", "ip": "10.0.0.1", "role": "master", "cluster": "c"},
    "paused": False, "redeploying": False, "node_policy": {"failed": False, "failed_reason": "", "redeploys_total": 0},
    "components": {"vllm": {"kind": "vllm", "state": "ready", "desired": "running", "pid": 42, "ready": True,
                            "up": True, "restarts": 2, "uptime_s": 12.5, "last_exit": None, "held": None,
                            "probes": {"runs": 7}, "policy": {"crash_loop": True}}},
}  # fmt: skip


def test_status_payload_mirrors_status_and_changes_only_with_it() -> None:
    agent = {"version": "0.1.0", "pid": 7, "started_at": 1.0}
    payload = status_payload("running", SUP_STATUS, agent, {"vllm": {"eff_total": 0.5}}, 3, now=100.0)
    assert payload["state"] == "running" and payload["node"] == SUP_STATUS["node"] and payload["mqtt"] == {"dropped": 3}
    assert payload["components"]["vllm"] == {"kind": "vllm", "state": "ready", "desired": "running", "pid": 42,
                                             "ready": True, "up": True, "restarts": 2, "held": None,
                                             "last_exit": None, "crash_loop": True}  # fmt: skip
    json.dumps(payload)
    later = status_payload("running", {**SUP_STATUS}, agent, {"vllm": {"eff_total": 0.9}}, 3, now=130.0)
    assert status_digest(later) == status_digest(payload), "time, uptime and cache rates are no change"
    stopping = status_payload("stopping", SUP_STATUS, agent, {}, 3, now=130.0)
    assert status_digest(stopping) != status_digest(payload)
    assert offline_payload("c", "n1") == {"state": "offline", "node": {"name": "n1", "cluster": "c"},
                                          "reason": offline_payload("c", "n1")["reason"]}  # fmt: skip


def test_cache_payload_uses_the_watch_scripts_columns() -> None:
    first = {"0": CacheCounters("0", 100.0, 40.0, 60.0, 30.0), "1": CacheCounters("1", 100.0, 60.0, 40.0, 10.0)}
    rows = {"vllm": compute_table(None, first)}
    payload = cache_payload(rows, now=time.time())
    table = payload["components"]["vllm"]
    assert [r["engine"] for r in table] == ["0", "1", "all"]
    assert table[2]["local_total"] == pytest.approx(0.5) and table[2]["eff_total"] == pytest.approx(0.7)
    assert cache_summary(rows) == {"vllm": {"local_win": pytest.approx(0.5), "local_total": pytest.approx(0.5),
                                            "ext_win": pytest.approx(0.4), "ext_total": pytest.approx(0.4),
                                            "eff_total": pytest.approx(0.7)}}  # fmt: skip


# ---- the persisted event sequence number --------------------------------------------------------------------


def test_resume_seq_rules() -> None:
    assert resume_seq(None, "boot-a") == (1, None)
    assert resume_seq(SavedSeq(41, "boot-a", clean=False), "boot-a") == (42, None)  # kill -9: page cache kept it
    assert resume_seq(SavedSeq(41, "boot-a", clean=True), "boot-b") == (42, None)  # clean stop, then a reboot
    first, why = resume_seq(SavedSeq(41, "boot-a", clean=False), "boot-b")  # the machine died under the agent
    assert first == 41 + SEQ_JUMP_AFTER_CRASH and why is not None and "skipped" in why


def test_seq_carries_on_across_bus_instances_without_close(tmp_path: Path) -> None:
    """A kill -9 of the agent is a bus that never closed: the next one continues at +1, no number reused."""
    path = tmp_path / "state" / "events.seq"
    bus = EventBus(seq_path=path)
    assert [bus.emit("x", "m").seq for _ in range(3)] == [1, 2, 3]
    record = SavedSeq.parse(path.read_bytes())
    assert record.last == 3 and not record.clean
    again = EventBus(seq_path=path)
    assert again.emit("x", "m").seq == 4
    again.close()
    assert SavedSeq.parse(path.read_bytes()).clean
    assert again.emit("x", "late").seq == 5 and not SavedSeq.parse(path.read_bytes()).clean, "an emit after close"
    assert EventBus(seq_path=path).emit("x", "m").seq == 6


def test_seq_jumps_after_an_unclean_reboot_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "events.seq"
    path.write_bytes(SavedSeq(10, "another-boot", clean=False).record())
    bus = EventBus(seq_path=path)
    ev1 = bus.emit("agent_start", "m")
    skipped = bus.recent[0]
    assert skipped.event == "seq_discontinuity" and skipped.level == "warning"
    assert skipped.seq == 10 + SEQ_JUMP_AFTER_CRASH
    assert ev1.seq == skipped.seq + 1


def test_seq_file_unreadable_or_unwritable(tmp_path: Path) -> None:
    path = tmp_path / "events.seq"
    path.write_bytes(b"garbage")
    first, why = SeqFile(path).load()
    assert first == 1 and why is not None and "unreadable" in why
    blocked = tmp_path / "file"
    blocked.write_text("")
    bus = EventBus(seq_path=blocked / "events.seq")  # its folder is a file: persistence off, events still flow
    assert [bus.emit("x", "m").seq for _ in range(2)] == [2, 3]
    assert bus.recent[0].event == "seq_discontinuity" and "unreadable" in bus.recent[0].message


def test_seq_record_is_fixed_width() -> None:
    small, big = SavedSeq(1, "b", False).record(), SavedSeq(10**15, "b" * 40, True).record()
    assert len(small) == len(big) and SavedSeq.parse(big).last == 10**15


# ---- nodeagentctl status --------------------------------------------------------------------------------------


def test_cli_shows_the_mqtt_link() -> None:
    now = 1000.0
    up = {"connected": True, "broker": "mqtt://b:1883", "connected_since": 880.0, "queued": 0, "dropped": 2}
    assert format_mqtt(up, now) == "mqtt: connected to mqtt://b:1883 for 2m00s · queued 0 · dropped 2"
    down = {"connected": False, "broker": "mqtts://b:8883", "last_error": "the broker refused the credentials",
            "queued": 17, "dropped": 0}  # fmt: skip
    assert format_mqtt(down, now) == ("mqtt: DISCONNECTED from mqtts://b:8883: the broker refused the credentials · "
                                      "queued 17 · dropped 0")  # fmt: skip
    text = format_status({"node": {}, "agent": {}, "components": {}, "mqtt": down}, now)
    assert "DISCONNECTED from mqtts://b:8883" in text
    assert "mqtt" not in format_status({"node": {}, "agent": {}, "components": {}}, now)
