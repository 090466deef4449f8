"""A key's value read as JSON (`cluster.store.KV.json`): msgspec's decoder, with the standard one behind it for what
msgspec refuses, so a record decodes exactly as `json.loads` decodes it."""

from __future__ import annotations

import json

import pytest

from nodeagent.cluster.store import KV


@pytest.mark.parametrize("value", [
    b'{"node":"n1","components":{"vllm":{"state":"ready","pid":12,"since":1796668990.39}},"hold":null}',
    b'{"x": NaN, "y": Infinity}',  # json.dumps writes these; msgspec refuses them
    b"123456789012345678901234567890",  # past 64 bits
    json.dumps({"s": "\ud800"}).encode(),  # a lone surrogate
    b"\xff\xfe{\x00}\x00",  # UTF-16, which json.loads detects
])  # fmt: skip
def test_a_value_decodes_as_json_loads_decodes_it(value: bytes) -> None:
    got, want = KV("k", value, 1, 1).json(), json.loads(value)
    assert json.dumps(got) == json.dumps(want)


@pytest.mark.parametrize("value", [b"", b"not json", b"[1,2", b"\xe9"])
def test_a_value_that_is_not_json_is_none(value: bytes) -> None:
    assert KV("k", value, 1, 1).json() is None
