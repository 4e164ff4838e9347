"""The layout's rule: a package of ``scheduler/`` imports only the packages below it in docs/architecture.md's list.

The order is read from the page's layout block, and every import in a
package's files (those inside functions too) is checked against it, from
the sources alone. The calls up the list that the design has today are
``UPWARD``, each with its reason; a new one fails here until it is listed
(and the page says why), or the code calls down instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scheduler"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: (importing package module, imported module): why it calls a layer above its own.
UPWARD: dict[tuple[str, str], str] = {
    ("scheduler.beat.housekeeping", "scheduler.ops.reconcile"): "the leader runs the operators' reconcile on a timer",
    ("scheduler.beat.housekeeping", "scheduler.ops.watch"): "the leader runs the incident watch",
    ("scheduler.beat.scheduler", "scheduler.ops.builtin_schedules"): "a beat declares the built-in schedules at start",
    (
        "scheduler.beat.scheduler",
        "scheduler.ops.settings_schedules",
    ): "a beat declares the settings' schedules at start",
    ("scheduler.worker.receivers", "scheduler.ops.watch"): "a worker's main process runs the incident watch too",
    ("scheduler.owners.leases", "scheduler.beat.liveness"): "a lease's holder is told apart alive by its session",
    ("scheduler.owners.schedules", "scheduler.beat.liveness"): "an edit wakes the leader (NOTIFY on PostgreSQL)",
    ("scheduler.models.schedule", "scheduler.timing"): "the model validates its timing",
    ("scheduler.models.schedule", "scheduler.timing.calendars"): "the model's days filter is the calendars' type",
    ("scheduler.models.schedule", "scheduler.owners.calendars"): "the model reads its calendars' days (cached)",
}


def layers() -> list[str]:
    """The packages of the page's layout block, top layer first."""
    text = ARCHITECTURE.read_text()
    block = text.split("## The layout", 1)[1].split("```", 2)[1]
    return re.findall(r"^  (\w+)/ ", block, flags=re.M)


def imports(source: str, module: str) -> set[str]:
    """The ``scheduler.*`` modules ``source`` (the file of ``module``) imports.

    ``from p import n`` imports the module ``p.n`` where there is one, else a name of ``p``.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                base = ".".join([*module.split(".")[: -node.level], *([base] if base else [])])
            found |= {f"{base}.{alias.name}" if _exists(f"{base}.{alias.name}") else base for alias in node.names}
    return {name for name in found if name.startswith("scheduler.")}


def upward(order: list[str], module: str, imported: set[str]) -> set[str]:
    """Those of ``imported`` in a layer above ``module``'s."""
    rank = {name: n for n, name in enumerate(order)}
    own = rank[module.split(".")[1]]
    return {name for name in imported if name.split(".")[1] in rank and rank[name.split(".")[1]] < own}


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def violations() -> dict[tuple[str, str], Path]:
    order = layers()
    found = {}
    for layer in order:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for name in upward(order, module, imports(path.read_text(), module)):
                found[(module, name)] = path
    return found


def test_the_page_lists_every_package() -> None:
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert set(layers()) == packages - {"migrations", "templatetags"}, layers()


def test_every_package_calls_only_down_but_for_the_listed_calls() -> None:
    found = violations()
    new = sorted(set(found) - set(UPWARD))
    assert not new, "calls up the layers, not in UPWARD: " + ", ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(set(UPWARD) - set(found))
    assert not gone, "listed in UPWARD but no longer made: " + ", ".join(f"{a} -> {b}" for a, b in gone)


def test_the_scan_catches_a_planted_call_up() -> None:
    # Given an owner's module that imports the beat, and another that imports it inside a function
    order = layers()
    plain = "from scheduler.beat import dispatch\n"
    inside = "def f():\n    from scheduler.web import metrics\n    return metrics\n"
    relative = "from ..ops import reconcile\n"
    # Then each is a call up the layers, and a call down is not
    assert upward(order, "scheduler.owners.x", imports(plain, "scheduler.owners.x")) == {"scheduler.beat.dispatch"}
    assert upward(order, "scheduler.owners.x", imports(inside, "scheduler.owners.x")) == {"scheduler.web.metrics"}
    assert upward(order, "scheduler.owners.x", imports(relative, "scheduler.owners.x")) == {"scheduler.ops.reconcile"}
    assert (
        upward(order, "scheduler.beat.x", imports("from scheduler.owners import leases\n", "scheduler.beat.x")) == set()
    )
