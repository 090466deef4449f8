"""The config models' machinery on msgspec: strict frozen structs, field checks, and validation that says where.

msgspec, not pydantic, because the daemon keeps what it imports: pydantic cost the idle agent ~15 MB of RSS
(docs/architecture.md, "Why msgspec"). msgspec checks types and `Meta` constraints while converting; what it has
no word for lives here:
- `Check(func)` in a field's `Annotated[...]` (pydantic's AfterValidator): `func(value)` returns the value to keep
  or raises ValueError. `Strict.__post_init__` runs the checks, then the struct's `_problems()` (cross-field
  rules, only when every field passed), on construction, conversion and `replace` — so checks are idempotent.
- the validation context: `validate(..., base_dir=)` sets the folder relative config paths resolve against.
- every problem, not only the first: msgspec stops at the first error; `validate` drops the offending key and
  converts again, and reports each problem with its key path in the data (msgspec writes `[...]` for a dict key;
  the key is found by converting the entries one by one).
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import msgspec

KeyPath = tuple[str | int, ...]
RuleProblem = tuple[str | KeyPath | None, str]
"""What a struct's `_problems()` yields: (its key, a key path within it, or None for the struct; the message)."""
_BASE_DIR: ContextVar[Path | None] = ContextVar("nodeagent_config_base_dir", default=None)


def base_dir() -> Path | None:
    """The folder of the config file being validated (None outside `validate` or without a file)."""
    return _BASE_DIR.get()


_S = TypeVar("_S", bound=msgspec.Struct)


class Check:
    """`Annotated[T, Check(func)]`: `func(value) -> value`, ValueError for a bad one (None values are skipped)."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func


class FieldProblems(ValueError):
    """Raised by `Strict.__post_init__`: (key path within the struct, message) pairs."""

    def __init__(self, problems: list[tuple[KeyPath, str]], model_level: bool) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, p)) or '(struct)'}: {m}" for p, m in problems))
        self.problems = problems
        self.model_level = model_level


class Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Unknown keys are errors, instances are immutable (`replace` makes changed copies). `kw_only` holds for
    the fields a class declares itself: a subclass with a required field after defaults says it again."""

    def __post_init__(self) -> None:
        problems: list[tuple[KeyPath, str]] = []
        for name, checks, each in _checks_of(type(self)):
            value = getattr(self, name)
            if value is None:
                continue
            if each:
                items = []
                for i, item in enumerate(value):
                    try:
                        items.append(_apply(checks, item))
                    except ValueError as exc:
                        problems.append(((name, i), str(exc)))
                new = items
            else:
                try:
                    new = _apply(checks, value)
                except ValueError as exc:
                    problems.append(((name,), str(exc)))
                    continue
            if new is not value:
                msgspec.structs.force_setattr(self, name, new)
        if problems:
            raise FieldProblems(problems, model_level=False)
        model = [((key,) if isinstance(key, str) else tuple(key or ()), msg) for key, msg in self._problems()]
        if model:
            raise FieldProblems(model, model_level=True)

    def _problems(self) -> Iterable[RuleProblem]:
        """Cross-field rules: (key or key path or None for the struct itself, message)."""
        return ()


class Tagged(Strict, tag_field="kind", frozen=True):
    """A member of a union told apart by `kind:` (msgspec's tag: not a field, read through this property)."""

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


def replace(obj: _S, **changes: Any) -> _S:
    """A copy with these fields changed (checks run again, constraints are not: like pydantic's model_copy)."""
    return msgspec.structs.replace(obj, **changes)


def to_plain(obj: Any) -> Any:
    """Builtins (paths as strings, a tagged struct with its `kind`): what a hash or JSON takes."""
    return msgspec.to_builtins(obj, enc_hook=str)


def _apply(checks: tuple[Check, ...], value: Any) -> Any:
    for check in checks:
        value = check.func(value)
    return value


def _unwrap(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """(the type without Annotated and None, the Annotated metadata)."""
    meta: tuple[Any, ...] = ()
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            args = typing.get_args(tp)
            tp, meta = args[0], (*meta, *args[1:])
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) != 1:
                return tp, meta
            tp = members[0]
        else:
            return tp, meta


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


@cache
def _checks_of(cls: type) -> tuple[tuple[str, tuple[Check, ...], bool], ...]:
    """(field, its checks, whether they apply to each item of a list) for the fields that have checks."""
    out = []
    for name, tp in _field_types(cls).items():
        inner, meta = _unwrap(tp)
        checks = tuple(m for m in meta if isinstance(m, Check))
        if checks:
            out.append((name, checks, False))
        elif typing.get_origin(inner) is list:
            item_checks = tuple(m for m in _unwrap(typing.get_args(inner)[0])[1] if isinstance(m, Check))
            if item_checks:
                out.append((name, item_checks, True))
    return tuple(out)


def fields_of(cls: type[msgspec.Struct]) -> tuple[str, ...]:
    """The keys a struct takes (without the ones marked internal)."""
    internal: frozenset[str] = getattr(cls, "INTERNAL_FIELDS", frozenset())
    return tuple(n for n in cls.__struct_fields__ if n not in internal)


# ---------------------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class Problem:
    """One thing wrong, at a key path of the data. `code`: unknown_key (`allowed`: the keys there), missing,
    missing_kind, unknown_kind (`allowed`: the kinds), value."""

    path: KeyPath
    message: str
    code: str = "value"
    allowed: tuple[str, ...] = ()
    model_level: bool = field(default=False, compare=False)

    def text(self) -> str:
        """What is wrong, in the loader's words (an unknown key suggests the closest known one)."""
        if self.code == "unknown_key":
            key = str(self.path[-1])
            close = difflib.get_close_matches(key, self.allowed, n=1, cutoff=0.6)
            return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        return self.message


class Invalid(ValueError):
    """Validation failed: every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, p.path)) or '(top level)'}: {p.message}" for p in problems))
        self.problems = problems


def _dec_hook(tp: Any, obj: Any) -> Any:
    if tp is Path and isinstance(obj, str):
        return Path(obj)
    raise TypeError(f"Input should be a path (a string), got {obj!r}")


def _convert(data: Any, tp: Any) -> Any:
    return msgspec.convert(data, tp, strict=False, dec_hook=_dec_hook)


def validate(tp: Any, data: Any, base_dir: Path | None = None) -> Any:
    """`data` (plain YAML/JSON values) as `tp`; Invalid with every problem. `base_dir`: see `base_dir()`."""
    token = _BASE_DIR.set(base_dir)
    try:
        try:
            return _convert(data, tp)
        except msgspec.ValidationError as exc:
            raise Invalid(_collect(data, tp, exc)) from None
    finally:
        _BASE_DIR.reset(token)


def _collect(data: Any, tp: Any, exc: msgspec.ValidationError) -> list[Problem]:
    """Every problem: report the first, drop its key, convert again (a rule of a struct whose keys were dropped,
    or a "required" for a dropped key, is not reported: it would be about the cut-down data)."""
    work = copy.deepcopy(data)
    found: list[Problem] = []
    dropped: list[KeyPath] = []
    for _ in range(100):
        problems = _locate(work, tp, exc)
        for p in problems:
            hidden = p.path in dropped or (p.model_level and any(d[:len(p.path)] == p.path for d in dropped))
            if not hidden and p not in found:
                found.append(p)
        # an unknown kind goes with its object (else the next round says the object misses its kind)
        paths = [p.path[:-1] if p.code == "unknown_kind" else p.path for p in problems]
        targets = [t for t in (_drop_target(work, path) for path in paths) if t is not None]
        if not targets:
            break
        for target in dict.fromkeys(targets):
            _delete(work, target)
            dropped.append(target)
        try:
            _convert(work, tp)
            break
        except msgspec.ValidationError as again:
            exc = again
    return found or [Problem((), str(exc))]


def _get(data: Any, path: KeyPath) -> tuple[bool, Any]:
    cur = data
    for part in path:
        in_list = isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        if not (in_list or (isinstance(cur, dict) and part in cur)):
            return False, None
        cur = cur[part]
    return True, cur


def _drop_target(data: Any, path: KeyPath) -> KeyPath | None:
    """The longest prefix of `path` that is a key of a mapping in the data (list items go with their list)."""
    for n in range(len(path), 0, -1):
        ok, parent = _get(data, path[:n - 1])
        if ok and isinstance(parent, dict) and path[n - 1] in parent:
            return path[:n]
    return None


def _delete(data: Any, path: KeyPath) -> None:
    _, parent = _get(data, path[:-1])
    parent.pop(path[-1], None)


_AT = re.compile(r" - at `(.*)`$")
_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[(\.\.\.)\]")


def _tokens(where: str) -> list[str | int | None]:
    """`$.a[0][...]` → ['a', 0, None] (None: some key of a mapping)."""
    out: list[str | int | None] = []
    for name, index, _ in _TOKEN.findall(where.removeprefix("$")):
        out.append(name if name else int(index) if index else None)
    return out


def _pick(tp: Any, value: Any) -> Any:
    """The member of a union this value is meant as (by its `kind` among structs, else by its shape)."""
    tp, _ = _unwrap(tp)
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return tp
    members = [_unwrap(a)[0] for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(value, dict):
        tag = value.get("kind")
        for m in members:
            if _tag(m) is not None and _tag(m) == tag:
                return m
        return next((m for m in members if isinstance(m, type) and issubclass(m, msgspec.Struct)),
                    next((m for m in members if typing.get_origin(m) is dict), tp))
    if isinstance(value, list):
        return next((m for m in members if typing.get_origin(m) is list), tp)
    return tp


def _tag(tp: Any) -> str | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and tp.__struct_config__.tag_field == "kind":
        return str(tp.__struct_config__.tag)
    return None


def tags(tp: Any) -> tuple[str, ...]:
    """The kinds of a tagged union (or of one tagged struct)."""
    tp, _ = _unwrap(tp)
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return tuple(t for m in members if (t := _tag(_unwrap(m)[0])) is not None)


def _step(tp: Any, value: Any, part: str | int | None) -> Any:
    tp = _pick(tp, value)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and isinstance(part, str):
        return _field_types(tp).get(part, Any)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (list, dict) and args:
        return args[-1]
    return Any


def _locate(data: Any, tp: Any, exc: msgspec.ValidationError) -> list[Problem]:
    """msgspec's one error as problems at key paths of the data."""
    text = str(exc)
    match = _AT.search(text)
    message = text[:match.start()] if match else text
    where = match.group(1) if match else "$"
    if where.startswith("key` in `"):  # a bad mapping key: "... - at `key` in `$.env`"
        where = where.removeprefix("key` in `")
    path: list[str | int] = []
    cur, cur_tp = data, tp
    for part in _tokens(where):
        if part is None:  # which key of the mapping? convert its entries one by one
            value_tp = _step(cur_tp, cur, None)
            for key, value in (cur.items() if isinstance(cur, dict) else ()):
                try:
                    _convert(value, value_tp)
                except msgspec.ValidationError as inner:
                    return [_prefixed(p, (*path, key)) for p in _locate(value, value_tp, inner)]
            break
        if part == "kind" and tags(cur_tp) and message.startswith("Invalid value"):
            kinds = tags(cur_tp)
            got = cur.get("kind") if isinstance(cur, dict) else None
            expected = ", ".join(repr(k) for k in kinds)
            return [Problem((*path, "kind"), f"unknown kind {got!r}; expected one of {expected}", "unknown_kind",
                            kinds)]
        cur_tp = _step(cur_tp, cur, part)
        path.append(part)
        ok, cur = _get(cur, (part,))
        if not ok:
            cur = None
    return _explain(tuple(path), cur, cur_tp, message, exc.__cause__)


def _prefixed(p: Problem, prefix: KeyPath) -> Problem:
    return Problem((*prefix, *p.path), p.message, p.code, p.allowed, p.model_level)


_UNKNOWN = re.compile(r"Object contains unknown field `(.+)`$")
_MISSING = re.compile(r"Object missing required field `(.+)`$")
_BOUND = re.compile(r"Expected `(\w+)` (>=|>|<=|<) (\S+)$")
_LENGTH = re.compile(r"Expected `(\w+)` of length (>=|<=) (\d+)$")
_TYPE = re.compile(r"Expected `([^`]+)`, got `(\w+)`$")
_WORDS = {"int": "a valid integer", "float": "a valid number", "str": "a valid string", "bool": "a valid boolean",
          "array": "a list", "object": "a mapping", "null": "null"}
_GOT = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "array": "a list",
        "object": "a mapping", "null": "null"}
_BOUND_WORDS = {">=": "greater than or equal to", ">": "greater than", "<=": "less than or equal to", "<": "less than"}


def _explain(path: KeyPath, value: Any, tp: Any, message: str, cause: BaseException | None) -> list[Problem]:
    if isinstance(cause, FieldProblems):
        return [Problem((*path, *sub), msg, model_level=cause.model_level) for sub, msg in cause.problems]
    if cause is not None:
        return [Problem(path, str(cause))]
    if m := _UNKNOWN.match(message):
        owner = _pick(tp, value)
        allowed = fields_of(owner) if isinstance(owner, type) and issubclass(owner, msgspec.Struct) else ()
        return [Problem((*path, m.group(1)), f"unknown key {m.group(1)!r}", "unknown_key", allowed)]
    if m := _MISSING.match(message):
        if m.group(1) == "kind" and tags(tp):
            return [Problem(path, "missing 'kind'", "missing_kind", tags(tp))]
        return [Problem((*path, m.group(1)), "Field required", "missing")]
    got = f", got {value!r}" if isinstance(value, str | int | float | bool) else ""
    if m := _BOUND.match(message):
        return [Problem(path, f"Input should be {_BOUND_WORDS[m.group(2)]} {m.group(3)}{got}")]
    if m := _LENGTH.match(message):
        unit = "character" if m.group(1) == "str" else "item"
        bound = "at least" if m.group(2) == ">=" else "at most"
        count = int(m.group(3))
        what = "String" if m.group(1) == "str" else "List"
        return [Problem(path, f"{what} should have {bound} {count} {unit}{'' if count == 1 else 's'}")]
    if message.startswith("Invalid enum value"):
        choices = typing.get_args(_unwrap(tp)[0]) if typing.get_origin(_unwrap(tp)[0]) is typing.Literal else ()
        if choices:
            listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}" if len(choices) > 1 \
                else repr(choices[0])
            return [Problem(path, f"Input should be {listed}{got}")]
    if m := _TYPE.match(message):
        expected = " or ".join(_WORDS.get(w.strip(), f"a {w.strip()}") for w in m.group(1).split("|"))
        return [Problem(path, f"Input should be {expected}{got or ', got ' + _GOT.get(m.group(2), m.group(2))}")]
    return [Problem(path, message)]

