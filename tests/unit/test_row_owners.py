"""Each of the Schedule, Instance, Lease and Execution tables has one module that writes its rows.

The scan reads the source of ``scheduler/`` and ``project/`` (no database, no
imports) and fails on any write to one of those rows outside its owner: an
ORM ``save``/``update``/``delete``/``create``/``bulk_*``/``*_or_create`` on
the model, a queryset of it or a variable that holds one, or raw SQL that
inserts into, updates or deletes from its table. What it cannot follow (a
row reached through an untyped helper) it does not see: the owners stay
the place to look first, and this test keeps new writers from appearing
where they are easy to see.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from tests.support.source_scan import project_sources

#: Model -> the one module that writes its rows.
OWNERS = {
    "Schedule": "scheduler/owners/schedules.py",
    "Instance": "scheduler/owners/instances.py",
    "Lease": "scheduler/owners/leases.py",
    "Execution": "scheduler/owners/executions.py",
}
TABLES = {f"scheduler_{model.lower()}": model for model in OWNERS}

#: Writes that stay outside their owner, each with the reason. A new entry needs one too.
ALLOWED: dict[tuple[str, str], str] = {
    # The fast path's multi-row insert writes the rows the owner built
    # (``executions.insert`` calls it); it is generic over models and never
    # decides what a row holds.
    ("scheduler/fastpath/bulk_insert.py", "Execution"): "fast-path bulk insert, called by executions.insert",
}

WRITE_METHODS = {
    "save",
    "update",
    "delete",
    "bulk_create",
    "bulk_update",
    "get_or_create",
    "update_or_create",
    "create",
}
#: Methods whose result is the same model's rows: a variable assigned from them holds rows of that model.
_SQL_WRITE = re.compile(
    r"\b(?:INSERT\s+(?:OR\s+\w+\s+)?INTO|UPDATE|DELETE\s+FROM)\s+[\"'`]?\{?\s*"
    r"(?:(?P<table>scheduler_(?:schedule|instance|lease|execution))\b|(?P<model>Schedule|Instance|Lease|Execution)\._meta\.db_table)",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Write:
    path: str
    line: int
    model: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} on {self.model} rows outside {OWNERS[self.model]}"


def _models_in(node: ast.AST, known: dict[str, str]) -> str | None:
    """The owned model an expression names (directly or through a variable known to hold its rows), if any."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            if sub.id in OWNERS:
                return sub.id
            if sub.id in known:
                return known[sub.id]
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value in OWNERS:
            return sub.value  # a string annotation: "Schedule", "QuerySet[Schedule]"
    return None


def _root(node: ast.AST) -> ast.AST:
    """The start of a chain of attributes, calls and subscripts: ``a`` of ``a.b(c).d``."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node


#: A variable of this name whose value the scan cannot follow (a helper's result) is taken to hold that model's row.
_NAMED = {"schedule": "Schedule", "execution": "Execution"}
#: Calls whose result holds what their first argument holds: ``list(Schedule.objects.all())``.
_PASS_THROUGH = {"list", "tuple", "sorted", "set", "next", "iter", "reversed", "get_object_or_404"}


def _holds(node: ast.AST, known: dict[str, str]) -> str | None:
    """The owned model whose rows (or queryset) an expression evaluates to, as far as the source shows."""
    if isinstance(node, ast.BoolOp):
        return next((model for value in node.values if (model := _holds(value, known))), None)
    if isinstance(node, ast.IfExp):
        return _holds(node.body, known) or _holds(node.orelse, known)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PASS_THROUGH:
        return _holds(node.args[0], known) if node.args else None
    root = _root(node)
    if isinstance(root, ast.Name):
        return root.id if root.id in OWNERS else known.get(root.id, _NAMED.get(root.id))
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self.writes: list[Write] = []
        self.known: list[dict[str, str]] = [{}]

    # --- what each variable holds -------------------------------------------------------

    def _bind(self, target: ast.AST, model: str | None) -> None:
        if model is None:
            return
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                self.known[-1][sub.id] = model

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = dict(self.known[-1])
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for argument in arguments:
            if argument.annotation is not None:
                model = _models_in(argument.annotation, {})
                if model is not None:
                    scope[argument.arg] = model
        self.known.append(scope)
        self.generic_visit(node)
        self.known.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, _holds(node.value, self.known[-1]))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        model = _models_in(node.annotation, {})
        if model is None and node.value is not None:
            model = _holds(node.value, self.known[-1])
        self._bind(node.target, model)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._bind(node.target, _holds(node.iter, self.known[-1]))
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._bind(node.optional_vars, _holds(node.context_expr, self.known[-1]))
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, _holds(node.iter, self.known[-1]))
        self.generic_visit(node)

    # --- writes --------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in WRITE_METHODS:
            receiver = func.value
            # ``Model.objects.create(...)``; any other ``create`` is not a row write.
            plain_create = func.attr == "create" and not (
                isinstance(receiver, ast.Attribute) and receiver.attr in {"objects", "_base_manager"}
            )
            model = None if plain_create else _holds(receiver, self.known[-1])
            if model is not None:
                self._flag(node, model, f".{func.attr}()")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            self._sql(node, node.value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self._sql(node, ast.get_source_segment(self.source, node) or "")
        # Its parts are part of the segment just read: not visited again.

    def _sql(self, node: ast.AST, text: str) -> None:
        for match in _SQL_WRITE.finditer(text):
            model = match.group("model") or TABLES[match.group("table").lower()]
            self._flag(node, model, "raw SQL " + " ".join(match.group(0).split()[:1]).upper())

    def _flag(self, node: ast.AST, model: str, what: str) -> None:
        if self.path == OWNERS[model] or (self.path, model) in ALLOWED:
            return
        self.writes.append(Write(self.path, getattr(node, "lineno", 0), model, what))


def writes_outside_owners(path: str, source: str) -> list[Write]:
    """Return the writes of ``source`` (the file at ``path``, relative to the repository) outside their owner."""
    scan = _Scan(path, source)
    scan.visit(ast.parse(source, filename=path))
    return scan.writes


def test_every_row_is_written_by_its_owner_only() -> None:
    # Given the project's source
    # When every file is scanned
    found = [write for path, source in project_sources().items() for write in writes_outside_owners(path, source)]
    # Then no row is written outside its owner
    assert not found, "writes outside the row's owner:\n" + "\n".join(map(str, found))


def test_the_scan_sees_the_owners_files() -> None:
    # The scan reads the owners themselves too: a renamed owner would empty it silently.
    scanned = set(project_sources())
    assert set(OWNERS.values()) <= scanned


PLANTED = """
from scheduler.models import Execution, Instance, Schedule


def edit(schedule: Schedule) -> None:
    schedule.save()


def by_query(pk):
    rows = Schedule.objects.filter(pk=pk)
    rows.update(enabled=False)
    Instance.objects.filter(pk=pk).delete()
    Execution.objects.create(task="t")


def raw(cursor):
    cursor.execute("UPDATE scheduler_lease SET holder = ''")
    cursor.execute(f"DELETE FROM {Execution._meta.db_table} WHERE id = %s", [1])


def by_name(name):
    schedule = _get(name)
    schedule.delete()


def fine(queue, cache, parser):
    queue.delete()
    cache.update({"a": 1})
    parser.create("x")
"""


def test_the_scan_catches_planted_writes() -> None:
    # Given a module outside every owner that writes each kind of row
    # When it is scanned
    found = writes_outside_owners("scheduler/planted.py", PLANTED)
    # Then each write is reported, and nothing else
    assert [(write.line, write.model, write.what) for write in found] == [
        (6, "Schedule", ".save()"),
        (11, "Schedule", ".update()"),
        (12, "Instance", ".delete()"),
        (13, "Execution", ".create()"),
        (17, "Lease", "raw SQL UPDATE"),
        (18, "Execution", "raw SQL DELETE"),
        (23, "Schedule", ".delete()"),
    ]


def test_the_owner_may_write_its_own_rows_only() -> None:
    # Given the Schedule owner writing a schedule and an instance
    source = "from scheduler.models import Instance, Schedule\nSchedule.objects.filter().update(a=1)\nInstance.objects.all().delete()\n"
    # When it is scanned as the Schedule owner
    found = writes_outside_owners("scheduler/owners/schedules.py", source)
    # Then only the instance write is reported
    assert [(write.line, write.model) for write in found] == [(3, "Instance")]
