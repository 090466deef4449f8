"""The config models' machinery (`nodeagent.config.base`), on small structs of its own: no files, no processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import pytest
from msgspec import Meta, field

from nodeagent.config.base import Check, Invalid, Problem, RuleProblem, Strict, Tagged, replace, validate
from nodeagent.config.paths import Command, ConfigPath


def _no_slash(value: str) -> str:
    if "/" in value:
        raise ValueError("must not contain '/'")
    return value


class Probe(Tagged, tag="tcp"):
    port: Annotated[int, Meta(ge=1)] = 80


class Other(Tagged, tag="exec", kw_only=True):
    command: Command


class Item(Strict):
    name: Annotated[str, Check(_no_slash)] = "x"
    lo: int = 0
    hi: int = 10
    probes: list[Probe | Other] = field(default_factory=list)
    path: ConfigPath | None = None

    def _problems(self) -> Iterator[RuleProblem]:
        if self.lo > self.hi:
            yield None, "lo must not exceed hi"


class Top(Strict):
    items: dict[str, Item] = field(default_factory=dict)
    port: Annotated[int, Meta(gt=0, lt=65536)] = 1


def problems(data: object) -> list[tuple[str, str]]:
    with pytest.raises(Invalid) as info:
        validate(Top, data)
    return [(".".join(map(str, p.path)), p.text()) for p in info.value.problems]


def test_every_problem_with_its_key_path_also_under_mapping_keys() -> None:
    """msgspec names a mapping's key `[...]` and stops at the first error; each key is found and all reported."""
    found = problems({"items": {"a": {"lo": "x"}, "b": {"name": "p/q", "probes": [{"kind": "tcp", "port": 0}]}},
                      "port": 70000})  # fmt: skip
    assert found == [
        ("items.a.lo", "Input should be a valid integer, got 'x'"),
        ("items.b.probes.0.port", "Input should be greater than or equal to 1, got 0"),  # types before checks
        ("items.b.name", "must not contain '/'"),
        ("port", "Input should be less than or equal to 65535, got 70000"),
    ]


def test_unknown_keys_suggest_the_closest_and_kinds_are_named() -> None:
    assert problems({"items": {"a": {"hig": 1}}}) == [("items.a.hig", "unknown key 'hig' (did you mean 'hi'?)")]
    assert problems({"items": {"a": {"probes": [{"kind": "http"}]}}}) == [
        ("items.a.probes.0.kind", "unknown kind 'http'; expected one of 'tcp', 'exec'")]
    assert problems({"items": {"a": {"probes": [{"port": 1}]}}}) == [("items.a.probes.0", "missing 'kind'")]
    assert problems({"items": {"a": {"probes": [{"kind": "exec"}]}}}) == [
        ("items.a.probes.0.command", "Field required")]


def test_a_rule_runs_only_on_valid_keys() -> None:
    """Like pydantic's after-validators: a struct's rule is not judged on data cut down by an earlier problem."""
    assert problems({"items": {"a": {"lo": 5, "hi": 1}}}) == [("items.a", "lo must not exceed hi")]
    assert problems({"items": {"a": {"lo": 50, "hi": "x"}}}) == [("items.a.hi", "Input should be a valid integer, "
                                                                              "got 'x'")]  # fmt: skip


def test_substituted_strings_convert_and_paths_resolve_against_the_folder(tmp_path: Path) -> None:
    top = validate(Top, {"items": {"a": {"lo": "3", "path": "sub/f", "probes": [
        {"kind": "exec", "command": "./run.sh"}, {"kind": "tcp", "port": "8000"}]}}}, base_dir=tmp_path)
    item = top.items["a"]
    assert item.lo == 3 and item.path == tmp_path / "sub" / "f"
    assert item.probes[0].command == [str(tmp_path / "run.sh")] and item.probes[1].port == 8000
    assert [p.kind for p in item.probes] == ["exec", "tcp"]


def test_checks_run_on_construction_and_replace_and_are_idempotent() -> None:
    assert Other(command="prog").command == ["prog"]  # a default or a direct value passes the checks too
    with pytest.raises(ValueError, match="must not contain"):
        Item(name="a/b")
    with pytest.raises(ValueError, match="lo must not exceed hi"):
        replace(Item(), lo=11)
    done = validate(Item, {"path": "/a/../b"})
    assert done.path == Path("/b") and replace(done, lo=1).path == Path("/b")


def test_problem_text_without_a_close_match() -> None:
    assert Problem(("x", "zzz"), "", "unknown_key", ("port",)).text() == "unknown key 'zzz'"
