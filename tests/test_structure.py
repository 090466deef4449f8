"""The product package's shape: no import circle, no module over 600 lines.

The import graph is read from the source (ast), not from `sys.modules`: every `import` counts — at the top, inside
functions, and under `if TYPE_CHECKING:` — because a circle a function-level import hides is still a circle in
the design, and a TYPE_CHECKING import that mirrors a two-way dependency is the same circle written for the type
checker.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nodeagent"
MAX_LINES = 600

KNOWN_EDGES: dict[tuple[str, str], str] = {
    # (importer, imported): owner. Edges of circles being removed on other branches of issue 15; the merger
    # empties this list as those branches land (an entry whose edge is gone fails the test: delete it).
}
KNOWN_LONG: dict[str, str] = {
    # module: owner. Modules over MAX_LINES being split on other branches of issue 15 (the merger empties it).
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules this one imports, anywhere in its body (parents of a dotted module included: Python
    runs their __init__ first)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                # a module's own parent packages are already initialising when it runs: no edge
                if candidate in known and candidate != name and not name.startswith(candidate + "."):
                    out.add(candidate)
    return out


def import_graph() -> dict[str, set[str]]:
    """A fresh copy (callers edit it) of the one read of the package per run: three tests read it."""
    return {name: set(targets) for name, targets in _package_graph().items()}


@functools.cache
def _package_graph() -> dict[str, frozenset[str]]:
    found = modules()
    known = set(found)
    return {name: frozenset(imported(name, path, known)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    folder = tmp_path / "nodeagent"
    (folder / "ui").mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "ui" / "__init__.py").write_text("")
    (folder / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nodeagent.b import B\n")
    (folder / "b.py").write_text("def f():\n    from nodeagent import c\n")
    (folder / "c.py").write_text("import nodeagent.ui.d\n")
    (folder / "ui" / "d.py").write_text("from ..a import x\nfrom . import e\n")
    (folder / "ui" / "e.py").write_text("")
    known = {"nodeagent", "nodeagent.a", "nodeagent.b", "nodeagent.c", "nodeagent.ui", "nodeagent.ui.d",
             "nodeagent.ui.e"}  # fmt: skip
    graph = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(tmp_path).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = imported(name, path, known)
    # a module's own parent packages are no edge (they are initialising when it runs)
    assert graph["nodeagent.a"] == {"nodeagent.b"}
    assert graph["nodeagent.b"] == {"nodeagent.c"}
    assert graph["nodeagent.c"] == {"nodeagent.ui", "nodeagent.ui.d"}
    assert graph["nodeagent.ui.d"] == {"nodeagent.a", "nodeagent.ui.e"}
    assert cycles(graph) == [["nodeagent.a", "nodeagent.b", "nodeagent.c", "nodeagent.ui.d"]]


def test_no_import_circle() -> None:
    graph = import_graph()
    stale = [edge for edge in KNOWN_EDGES if edge[1] not in graph.get(edge[0], set())]
    assert not stale, f"these known edges are gone: delete them from KNOWN_EDGES: {stale}"
    for importer, target in KNOWN_EDGES:
        graph[importer] = graph[importer] - {target}
    found = cycles(graph)
    assert not found, "import circles in nodeagent (each: the modules that import one another):\n" + "\n".join(
        " ↔ ".join(c) for c in found)  # fmt: skip


def test_no_module_over_600_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    stale = [name for name in KNOWN_LONG if sizes.get(name, 0) <= MAX_LINES]
    assert not stale, f"these modules are short now: delete them from KNOWN_LONG: {stale}"
    long = {name: n for name, n in sizes.items() if n > MAX_LINES and name not in KNOWN_LONG}
    assert not long, f"product modules over {MAX_LINES} lines: {long}"


NODE_LAYERS = ("layers.guards", "layers.chip_reset", "layers.kvlog", "layers.worker_headroom", "container.mode",
               "api.mqtt", "api.metrics", "agent")
"""Node-side modules that see the node through a port (or, for the composition root, attach to it)."""
SIDE_DOOR = re.compile(r"getattr\((self\.)?(port|sup|_sup|host|co|coordinator)\b|\.recovery_view\s*=|"
                       r"on_state_change\.(append|remove)\((self\.)?(_publish|status_changed|membership)")
"""A port read by `getattr`, an attribute assigned onto the port, a second change channel beside `attach`."""


def seam_modules() -> dict[str, Path]:
    return {name: path for name, path in modules().items()
            if name.startswith("nodeagent.cluster.") or name.removeprefix("nodeagent.") in
            (*NODE_LAYERS, "seam.stackport", "node.nodeport")}  # fmt: skip


def test_the_seams_have_one_door_each() -> None:
    """Issue 28 item 2: the layers see the node only through `StackPort` and the coordinator only through
    `coordinator_port.CoordinatorPort`; nothing reads the port by `getattr`, assigns onto it, silences the type
    checker about it, or listens beside `attach`; only the composition root (`agent`) knows the `Coordinator`."""
    importers = {m for m, targets in import_graph().items() if "nodeagent.cluster.coordinator" in targets}
    assert importers <= {"nodeagent.agent"}, f"only the composition root imports the Coordinator: {importers}"
    found = []
    for path in seam_modules().values():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SIDE_DOOR.search(line) or ("type: ignore" in line and re.search(r"\bport\b", line)):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "side doors around the seam:\n" + "\n".join(found)
    attaching = [name for name, path in seam_modules().items() if name != "nodeagent.agent"
                 and re.search(r"\.attach\(", path.read_text())]  # fmt: skip
    assert not attaching, f"a layer attaches itself (the order of layers is agent.Agent.layers'): {attaching}"
    assert "on_state_change" not in (PACKAGE / "node" / "supervisor.py").read_text(), "one change channel: `attach`"


def test_the_side_door_pattern_finds_what_it_is_for() -> None:
    for line in ('base_env=getattr(self.port, "base_env", {})', "port.recovery_view = self.view",
                 "self.supervisor.on_state_change.append(self.membership.status_changed)",
                 "getattr(self._sup, name)"):  # fmt: skip
        assert SIDE_DOOR.search(line), line
    assert not SIDE_DOOR.search("self.store.on_state_change.append(lambda _s: self.wake())")


# The packages, lowest first: a module imports only from its own package and from those before it. The reasons
# for the order are in docs/architecture.md ("Packages"); the agent's composition root (`nodeagent.agent`, run by
# `nodeagent.__main__`) stands above every package: nothing imports it (`cli` talks to a running agent).
LAYERS: tuple[str, ...] = (
    "core", "vllm", "config", "seam", "render", "npu", "probes", "node", "container", "layers", "cluster", "api", "cli",
)  # fmt: skip
ROOT_MODULES = {"nodeagent", "nodeagent.agent", "nodeagent.__main__"}
SUBPACKAGE_RULES: dict[str, str] = {
    # (package): the subpackage inside it that the rest of the package never imports
    "nodeagent.cluster": "nodeagent.cluster.rollout",
}


def rank(module: str) -> int:
    """A module's place in LAYERS; the composition root above them all."""
    if module in ROOT_MODULES:
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == "nodeagent":
                continue
            if rank(target) > rank(importer):
                out.append(f"{importer} → {target}")
            for package, sub in SUBPACKAGE_RULES.items():
                inside = importer.startswith(package + ".") and not importer.startswith(sub)
                if inside and (target == sub or target.startswith(sub + ".")):
                    out.append(f"{importer} → {target} ({package} never imports its {sub})")
    return out


def test_every_module_is_in_a_declared_package() -> None:
    stray = [name for name in modules() if name not in ROOT_MODULES and name.split(".")[1] not in LAYERS]
    assert not stray, f"modules outside the declared packages {LAYERS}: {stray}"


def test_imports_go_one_way() -> None:
    found = wrong_way(import_graph())
    assert not found, "imports against the declared direction (docs/architecture.md, Packages):\n" + "\n".join(found)


def test_the_direction_check_sees_a_wrong_way_import() -> None:
    graph = {
        "nodeagent.core.errors": {"nodeagent.node.supervisor"},
        "nodeagent.node.supervisor": {"nodeagent.core.errors"},
        "nodeagent.cluster.coordinator": {"nodeagent.cluster.rollout.plan"},
        "nodeagent.cli.status": {"nodeagent.agent"},
        "nodeagent.agent": {"nodeagent.api.server"},
    }
    assert wrong_way(graph) == [
        "nodeagent.cli.status → nodeagent.agent",
        "nodeagent.cluster.coordinator → nodeagent.cluster.rollout.plan "
        "(nodeagent.cluster never imports its nodeagent.cluster.rollout)",
        "nodeagent.core.errors → nodeagent.node.supervisor",
    ]


def test_every_package_says_what_it_is() -> None:
    for name, path in modules().items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc) > 40, f"{name} has no docstring saying what the package is"
