"""The cluster's consistency rules, pure: hash seed, cluster file and version, membership, ranks, clock skew."""

from __future__ import annotations

from typing import Any

from nodeagent.cluster.consistency import ClockSamples, Expected, check_all, check_clock, relative_offsets

FILE = [Expected("a2-0", "10.0.0.1", "master", "g", (0, 8)), Expected("a2-1", "10.0.0.2", "worker", "g", (8, 8)),
        Expected("a2-2", "10.0.0.3", "worker", "g", (16, 8))]  # fmt: skip


def member(name: str, start: int, **extra: Any) -> dict[str, Any]:
    record = {"name": name, "ip": "10.0.0.9", "role": "worker", "group": "g", "ranks": {"start": start, "count": 8},
              "version": "0.1.0", "cluster_hash": "h1", "pythonhashseed": {"vllm": "0"},
              "agent": {"host": f"host-{name}"}}  # fmt: skip
    record.update(extra)
    return record


def healthy() -> dict[str, dict[str, Any]]:
    return {"a2-0": member("a2-0", 0), "a2-1": member("a2-1", 8), "a2-2": member("a2-2", 16)}


def codes(findings: list[Any]) -> list[tuple[str, str]]:
    return [(f.code, f.node) for f in findings]


def test_a_consistent_cluster_has_no_findings() -> None:
    assert check_all(FILE, healthy(), {}, {"a2-0": 0.0, "a2-1": 0.01, "a2-2": -0.02}, 1.0) == []


def test_the_odd_hash_seed_is_named_even_between_two() -> None:
    members = healthy()
    members["a2-1"]["pythonhashseed"] = {"vllm": "1"}
    findings = check_all(FILE, members, {}, {}, 1.0)
    assert codes(findings) == [("pythonhashseed", "a2-1")]
    assert "'1' differs from the cluster's '0'" in findings[0].message
    two = {n: members[n] for n in ("a2-0", "a2-1")}
    assert codes(check_all(FILE[:2], two, {}, {}, 1.0)) == [("pythonhashseed", "a2-1")], "a tie prefers 0"
    two["a2-0"]["pythonhashseed"] = {"vllm": "7"}
    assert codes(check_all(FILE[:2], two, {}, {}, 1.0)) == [("pythonhashseed", "a2-1")], "then the master's"


def test_unset_or_mixed_seeds_on_one_node() -> None:
    members = healthy()
    members["a2-2"]["pythonhashseed"] = {"vllm-dp16": "0", "vllm-dp17": None}
    members["a2-1"]["pythonhashseed"] = {"vllm-dp8": "0", "vllm-dp9": "3"}
    findings = check_all(FILE, members, {}, {}, 1.0)
    assert codes(findings) == [("pythonhashseed", "a2-1"), ("pythonhashseed", "a2-2")]
    assert "unset for vllm-dp17" in findings[1].message and "vllm-dp8=0, vllm-dp9=3" in findings[0].message


def test_cluster_file_and_version_differences() -> None:
    members = healthy()
    members["a2-2"]["cluster_hash"] = "h2"
    members["a2-0"]["version"] = "0.2.0"
    assert codes(check_all(FILE, members, {}, {}, 1.0)) == [("cluster_hash", "a2-2"), ("version", "a2-0")]


def test_missing_unknown_and_duplicate_name() -> None:
    members = healthy()
    del members["a2-2"]
    members["stray"] = member("stray", 24)
    dup = {"a2-0": [{"ip": "10.0.0.7", "agent": {"host": "imposter"}}]}
    findings = check_all(FILE, members, dup, {}, 1.0)
    assert codes(findings) == [("duplicate_name", "a2-0"), ("missing", "a2-2"), ("unknown", "stray")]
    assert "held by host-a2-0" in findings[0].message and "also by imposter (10.0.0.7)" in findings[0].message
    assert codes(check_all(FILE, members, {}, {}, 1.0, missing_ok=True)) == [("unknown", "stray")]


def test_overlapping_ranks_in_a_group() -> None:
    members = healthy()
    members["a2-2"]["ranks"] = {"start": 12, "count": 8}
    findings = check_all(FILE, members, {}, {}, 1.0)
    assert codes(findings) == [("duplicate_rank", "a2-2")]
    assert "ranks 12..19, overlapping a2-1's 8..15" in findings[0].message


def test_clock_skew_names_the_bad_clock_from_any_observer() -> None:
    # true clocks: a2-0 +0, a2-1 +0, a2-2 +5 s. Offsets as seen from a2-0 and as seen from a2-2 (shifted by -5):
    from_a0 = {"a2-0": 0.0, "a2-1": -0.01, "a2-2": 4.99}
    from_a2 = {"a2-0": -5.01, "a2-1": -5.02, "a2-2": 0.0}
    for view in (from_a0, from_a2):
        findings = check_clock(view, 1.0)
        assert codes(findings) == [("clock_skew", "a2-2")]
        assert findings[0].message.startswith("clock ahead of the cluster's by ")
    # the master's clock is the bad one: still only the master is named
    assert codes(check_clock({"a2-0": -3.0, "a2-1": 0.0, "a2-2": 0.02}, 1.0)) == [("clock_skew", "a2-0")]
    # two members: the faster clock is named, from either side
    assert codes(check_clock({"x": 0.0, "y": 2.0}, 1.0)) == codes(check_clock({"x": -2.0, "y": 0.0}, 1.0)) == [
        ("clock_skew", "y")]  # fmt: skip
    assert relative_offsets({"x": 0.0}) == {"x": 0.0} and check_clock({"x": 9.0}, 1.0) == []


def test_clock_samples_keep_the_tightest_recent_bound() -> None:
    samples = ClockSamples()
    assert samples.estimate(100.0) is None
    # member 2 s ahead; latencies 0.30, 0.01, 0.12 s: the estimate is the least delayed sample
    for arrival, latency in ((100.0, 0.30), (115.0, 0.01), (130.0, 0.12)):
        samples.add(arrival, arrival + 2.0 - latency)
    assert abs(samples.estimate(131.0) - 1.99) < 1e-9  # type: ignore[operator]
    assert samples.estimate(2000.0) is None, "old samples expire (a clock may have been stepped since)"


def test_preflight_peers_from_a_cluster_view() -> None:
    from nodeagent.cluster.consistency import preflight_peers

    view = {"self": "a", "members": [
        {"name": "a", "present": True, "pythonhashseed": {"vllm": "0"}, "clock_offset_s": 0.0},
        {"name": "b", "present": True, "pythonhashseed": {"vllm-dp0": "0", "vllm-dp1": "1"}, "clock_offset_s": 2.5},
        {"name": "c", "present": False},
        {"name": "d", "present": True, "pythonhashseed": {}},
    ]}  # fmt: skip
    assert preflight_peers(view, 100.0) == [
        {"name": "b", "pythonhashseed": "1", "wall_clock": 102.5, "observed_at": 100.0},
        {"name": "d", "pythonhashseed": None},
    ]
