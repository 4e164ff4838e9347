"""The audit trail is written by the actions, never composed by the admin, the API or a command.

The scan reads the source of ``scheduler/`` and ``project/`` (no database, no
imports) and fails on a call of a function of ``scheduler.ops.audit`` that
writes an event (``record``, and a long write's ``operation``) outside the
modules below: however the module is imported (``from scheduler.ops import
audit``, an alias, ``from scheduler.ops.audit import record``). The adapters
build an ``audit.Actor`` and call an action (``scheduler.ops.operations``),
which writes the change and its event in one transaction.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from tests.support.source_scan import project_sources

AUDIT_MODULE = "scheduler.ops.audit"
#: The audit module's functions that write an event.
WRITING = {"record", "operation"}

#: The modules that may record an event, each with the reason.
WRITERS: dict[str, str] = {
    "scheduler/ops/audit.py": "the trail itself: a long write's begin() records its started event",
    "scheduler/ops/operations.py": "the operator actions: each records its event with its change",
    # Users, groups, permissions and operator profiles are changed by Django's
    # own admin and commands (createsuperuser, the auth admin), which take no
    # actor: a model signal is the one place that sees every such change.
    "scheduler/ops/access_audit.py": "model-signal receivers for changes made by code this project does not own",
}


@dataclass(frozen=True)
class Call:
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: an audit event written outside {', '.join(WRITERS)}"


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        #: Names bound to the audit module, and names bound to its writing functions.
        self.modules: set[str] = set()
        self.records: set[str] = set()
        self.calls: list[Call] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == AUDIT_MODULE and alias.asname:
                self.modules.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if f"{node.module}.{alias.name}" == AUDIT_MODULE:
                self.modules.add(alias.asname or "audit")
            elif node.module == AUDIT_MODULE and alias.name in WRITING:
                self.records.add(alias.asname or alias.name)

    def visit_Call(self, node: ast.Call) -> None:
        if self._writes_event(node.func):
            self.calls.append(Call(self.path, node.lineno))
        self.generic_visit(node)

    def _writes_event(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self.records
        if not (isinstance(func, ast.Attribute) and func.attr in WRITING):
            return False
        owner = func.value
        if isinstance(owner, ast.Name):
            return owner.id in self.modules
        # ``scheduler.ops.audit.record(...)`` after ``import scheduler.ops.audit``.
        return ast.unparse(owner) == AUDIT_MODULE


def records_outside_writers(path: str, source: str) -> list[Call]:
    """Return the calls that write an audit event in ``source`` (the file at ``path``) unless it is one of ``WRITERS``."""
    if path in WRITERS:
        return []
    scan = _Scan(path)
    scan.visit(ast.parse(source, filename=path))
    return scan.calls


def test_only_the_actions_record_audit_events() -> None:
    # Given the project's source
    # When every file is scanned
    found = [call for path, source in project_sources().items() for call in records_outside_writers(path, source)]
    # Then audit events are written by the writers only
    assert not found, "audit events composed outside the actions:\n" + "\n".join(map(str, found))


def test_the_writers_exist() -> None:
    # A renamed writer would leave a stale entry, and its calls unscanned under the new name.
    scanned = set(project_sources())
    assert set(WRITERS) <= scanned


PLANTED = """
import scheduler.ops.audit
import scheduler.ops.audit as trail
from scheduler.ops import audit
from scheduler.ops import audit as au
from scheduler.ops.audit import record
from scheduler.ops.audit import record as note
from scheduler.ops.audit import operation


def save_model(request, obj):
    audit.record(audit.user_actor(request.user), "update", obj)
    au.record(audit.CLI, "create", obj)
    trail.record(audit.CLI, "create", obj)
    scheduler.ops.audit.record(audit.CLI, "create", obj)
    record(audit.CLI, "delete", obj)
    note(audit.CLI, "delete", obj)
    with audit.operation(audit.CLI, "prune", changes={}):
        pass
    with operation(audit.CLI, "reconcile", changes={}):
        pass


def fine(log, recorder):
    log.record("x")
    recorder.record(audit.snapshot(None))
    audit.snapshot(None)
"""


def test_the_scan_catches_planted_records() -> None:
    # Given an adapter that composes audit events itself, each way the module can be reached
    # When it is scanned
    found = records_outside_writers("scheduler/web/admin.py", PLANTED)
    # Then each call is reported, and nothing else
    assert [call.line for call in found] == [12, 13, 14, 15, 16, 17, 18, 20]


def test_a_writer_may_record() -> None:
    # Given the same source as one of the writers
    # When it is scanned
    # Then nothing is reported
    assert records_outside_writers("scheduler/ops/operations.py", PLANTED) == []
