"""When a drain ends (`nodeagent.node.drain.drain_end`), without processes."""

from nodeagent.node.drain import drain_end


def test_a_drain_ends_when_nothing_runs_or_waits() -> None:
    assert drain_end((0, 0), 3.25, 30, 0).event == "drained"
    assert drain_end((1, 0), 2.0, 30, 0) is None
    assert drain_end((0, 2), 2.0, 30, 0) is None


def test_unreadable_counters_end_it_on_the_third_read_in_a_row() -> None:
    assert drain_end(None, 1.0, 30, 2) is None
    end = drain_end(None, 1.0, 30, 3)
    assert end is not None and end.event == "drain_unknown" and end.level == "warning"


def test_the_timeout_ends_it_and_says_what_was_left() -> None:
    end = drain_end((3, 1), 30.0, 30, 0)
    assert end is not None and end.event == "drain_timeout" and "3 running, 1 waiting" in end.message
    assert "? running" in drain_end(None, 31.0, 30, 1).message  # type: ignore[union-attr]


def test_an_idle_engine_is_not_drained_before_the_load_balancer_saw_readiness_off() -> None:
    """Issue 33's campaign: `drained in 0.0s`, the rank stopped before the PD proxy removed it, and a request the
    proxy routed to it meanwhile came back 200 with an empty body — in a planned restart."""
    assert drain_end((0, 0), 0.0, 30, 0) is None
    assert drain_end((0, 0), 2.9, 30, 0) is None
    assert drain_end((0, 0), 3.0, 30, 0).event == "drained"  # type: ignore[union-attr]
    assert drain_end((0, 0), 1.0, 1.0, 0).event == "drained", "a drain timeout shorter than that bounds it"  # type: ignore[union-attr]
