"""Dependency order: start dependencies first, stop in reverse."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class DependencyCycleError(ValueError):
    pass


def start_order(deps: Mapping[str, Sequence[str]]) -> list[str]:
    """Topological order, stable with respect to the mapping's order (the YAML's order)."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        mark = state.get(name, 0)
        if mark == 2:
            return
        if mark == 1:
            cycle = [*trail[trail.index(name) :], name]
            raise DependencyCycleError(f"dependency cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in deps.get(name, ()):
            if dep in deps:
                visit(dep, [*trail, name])
        state[name] = 2
        order.append(name)

    for name in deps:
        visit(name, [])
    return order


def dependents(deps: Mapping[str, Sequence[str]], name: str) -> list[str]:
    """Every component that (transitively) depends on `name`, in start order."""
    affected = {name}
    result = []
    for comp in start_order(deps):
        if comp != name and any(d in affected for d in deps.get(comp, ())):
            affected.add(comp)
            result.append(comp)
    return result
