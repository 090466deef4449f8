"""The one reader of Prometheus text (vLLM's `/metrics`): samples by name, labels unescaped, values as floats.

Ours, not prometheus_client's `text_string_to_metric_families`, for three reasons its readers share:
- they want a handful of series of a page with hundreds of histogram buckets per DP engine (the progress probe
  reads it every period on every rank): the names are checked first, and only the wanted lines are parsed (a
  5,500-line page of 8 engines: 9 ms for two names, 32 ms strict, prometheus_client's parser 268 ms; loaded host);
- prometheus_client refuses a whole page for one line it cannot read, but the progress probe, the bake and the
  PD watch must read a page as far as it is theirs (`strict` is the cache watcher's: anything but metrics text,
  a 404 page say, is an error there);
- `nodeagentctl cache` and `bench` stay free of its ~70 ms import.
A line of a wanted series that does not parse (a truncated scrape) raises `MetricsTextError` (a ValueError, what
every reader treats as "this page cannot be read") rather than yielding a wrong value. Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LINE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)'  # the name
                   r'(?:\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'  # its labels, a quoted value may hold a }
                   r'[ \t]+(\S+)(?:[ \t]+(\S+))?[ \t]*$')  # the value, a timestamp
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsTextError(ValueError):
    """A line that is not Prometheus text: a wanted sample without a number, or anything at all when strict."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def _labels(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    return {m.group(1): _unescape(m.group(2)) for m in _LABEL.finditer(text)}


def samples(text: str, names: Container[str] | None = None, *, strict: bool = False) -> Iterator[Sample]:
    """The samples of `text` whose name is in `names` (every sample when None), in page order.

    Comments (`# HELP`/`# TYPE`) and blank lines are skipped; so is any other line unless `strict`."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.lstrip().startswith("#") or not line.strip():
            continue
        head = _NAME.match(line)
        wanted = head is not None and (names is None or head.group(0) in names)
        if not wanted and not strict:
            continue
        m = _LINE.match(line)
        value: float | None = None
        if m is not None:
            try:
                value = float(m.group(3))
            except ValueError:
                value = None
        if m is None or value is None:
            what = head.group(0) if head is not None else f"line {number}"
            raise MetricsTextError(f"{what} has no number: {line[:120]!r}")
        if wanted:
            yield Sample(m.group(1), _labels(m.group(2)), value)


__all__ = ["MetricsTextError", "Sample", "samples"]
