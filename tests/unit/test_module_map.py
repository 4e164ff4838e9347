"""docs/testing.md maps each module of ``scheduler/`` to the test files that exercise it; this keeps the map true.

The table under "Where each module is tested" is read as text, and so are
the sources (no database, no import of the app). Every module that holds
code is listed exactly once: migrations are left out, and so are the
``__init__.py`` files that only re-export (a docstring, imports, ``__all__``,
a lazy ``__getattr__``). Every file listed exists, and every test file
listed names the module it is mapped to: its dotted name, an import of it
or of a name its package re-exports from it, the command it implements, or
one of the markers below for the modules the tests reach only through a URL
or what they wire up. Naming a module does not prove a test exercises it,
but a test file that stops naming it no longer counts as its test.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "testing.md"
SECTION = "## Where each module is tested"
#: What a row says when no test exercises its module.
NONE = "none"

#: Modules no test exercises: only these may say ``none``. Empty: every module has a test.
UNTESTED: frozenset[str] = frozenset()

#: Pages and endpoints are reached through the test client, by the URLs they serve: their own
#: names appear in no test, so the URLs (or the setting or header the module reads) are the markers.
URLS: dict[str, tuple[str, ...]] = {
    "scheduler/admin.py": ("/admin/scheduler/",),  # admin autodiscovery: it only imports the admin pages
    "scheduler/web/admin.py": (
        "/admin/scheduler/schedule/",
        "/admin/scheduler/execution/",
        "/admin/scheduler/lease/",
        "/admin/scheduler/instance/",
        "admin:scheduler_",
    ),
    "scheduler/ops/cluster.py": (
        "/admin/scheduler/lease/",
        "/api/v1/cluster/",
    ),  # read through the cluster page (the lease list) and endpoint
    "scheduler/web/health.py": ("/healthz", "/readyz", "/leaderz"),
    "scheduler/web/metrics.py": ("/metrics",),
    "scheduler/web/metrics_token.py": ("SCHEDULER_METRICS_TOKEN",),
    "scheduler/web/middleware.py": ("/admin/auth/",),  # the user and group pages, whose ORM writes it attributes
    "scheduler/web/notification_admin.py": ("/admin/scheduler/notificationtarget/", "/admin/scheduler/notification/"),
    "scheduler/web/overview.py": ('"/admin/scheduler/"',),  # the app index, where the overview shows
    "scheduler/web/rule_admin.py": (
        "/admin/scheduler/concurrencylimit/",
        "/admin/scheduler/ratelimit/",
        "/admin/scheduler/calendar/",
    ),
    "scheduler/web/pause_admin.py": ("/admin/scheduler/pauserule/",),
    "scheduler/web/result_admin.py": ("/admin/django_celery_results/",),
    "scheduler/web/api/authentication.py": ("Bearer", "token_client("),  # token_client sends a Bearer token
    "scheduler/web/api/filters.py": ("/api/v1/schedules/?", "/api/v1/executions/?", "/api/v1/audit-events/?"),
    "scheduler/web/api/permissions.py": ("/api/v1/reconcile/", "== 403"),  # roles, and reconcile's unscoped rule
    "scheduler/web/api/policies.py": ("REST_FRAMEWORK",),  # the host setting the API's views must ignore
    "scheduler/web/api/schema.py": ("/api/schema/",),
    "scheduler/web/api/serializers.py": ("/api/v1/schedules/",),
    "scheduler/web/api/throttling.py": ("THROTTLE_RATE",),
    "scheduler/web/api/urls.py": ("/api/v1/", "/api/schema/", "/api/docs/"),
    "scheduler/web/api/views.py": ("/api/v1/",),
    "scheduler/templatetags/scheduler_admin.py": ("load scheduler_admin", "leader_warning", "leader-warning"),
}

#: Modules the tests reach only through what they wire up, read or write, each with the marker that shows it.
WIRED: dict[str, tuple[str, ...]] = {
    # The package's public API, resolved on first use: the tests call it by that name.
    "scheduler/__init__.py": ("scheduler.submit(", "scheduler.fenced(", "scheduler.current_execution("),
    # ready() connects the access audit's receivers and the groups' post_migrate receiver.
    "scheduler/apps.py": ("post_migrate",),
    # The leader hands its revokes to this thread: a cancel_previous schedule revokes its previous run.
    "scheduler/beat/revoker.py": ("revoke",),
    # The local wall clock: the tests that depend on it set it with time_machine.
    "scheduler/clock.py": ("time_machine.travel",),
    # Every command's one-line refusals and --json output.
    "scheduler/management/base.py": ("--json",),
    # The import_celery_beat command is its thin wrapper: the tests run the command.
    "scheduler/ops/import_celery_beat.py": ('"import_celery_beat"',),
    # Model-signal receivers of users and groups: their events are auth.user's and auth.group's.
    "scheduler/ops/access_audit.py": ("auth.user", "auth.group"),
    # The beat's heartbeat and reconcile write Instance rows through it; the tests read the rows.
    "scheduler/owners/instances.py": ("Instance.objects",),
    # A process id is <host>:<pid>: the tests find the process to kill from a lease holder's id.
    "scheduler/process_ids.py": ("pid_of(",),
    # The per-tenant task rule, set by the tests that check it.
    "scheduler/task_policy.py": ("SCHEDULER_TENANT_TASKS",),
    # Failing closed: a caller bound to no tenant sees nothing.
    "scheduler/tenancy.py": ("bound to no tenant",),
    # Off unless OTEL_TRACES_EXPORTER names an exporter.
    "scheduler/tracing.py": ("OTEL_TRACES_EXPORTER",),
    # The worker's threads: the heartbeat probe, the claim renewals, the guard every task runs under.
    "scheduler/worker/heartbeat.py": ("heartbeat",),
    "scheduler/worker/renewer.py": ("renew",),
    "scheduler/worker/task.py": ("ExecutionTask", "execution guard"),
}

_CELL = re.compile(r"`([^`]+)`")
_COMMANDS = Path("scheduler/management/commands")


@dataclass(frozen=True)
class Row:
    line: int
    module: str
    tests: tuple[str, ...]

    def where(self) -> str:
        return f"{PAGE.relative_to(ROOT)}:{self.line}"


# --- the table --------------------------------------------------------------------------------------


def _unquoted(cell: str) -> str:
    """A path in backticks, without them; anything else as written (no such file, then)."""
    quoted = _CELL.fullmatch(cell.strip())
    return quoted[1] if quoted else cell.strip()


def parse_table(text: str) -> list[Row]:
    """Return the rows of the table under ``SECTION`` in ``text``, with their line numbers."""
    lines = text.splitlines()
    assert SECTION in lines, f"{PAGE.relative_to(ROOT)} has no {SECTION!r} section"
    start = lines.index(SECTION) + 1
    rows: list[Row] = []
    for number, line in enumerate(lines[start:], start=start + 1):
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells == ["Module", "Tests"] or set("".join(cells)) <= set("-: "):
            continue  # the header and its separator
        assert len(cells) == 2, f"{PAGE.relative_to(ROOT)}:{number}: a row has two cells: {line!r}"
        module = _CELL.fullmatch(cells[0])
        assert module, f"{PAGE.relative_to(ROOT)}:{number}: the module is one path in backticks: {cells[0]!r}"
        tests = () if cells[1] == NONE else tuple(_unquoted(cell) for cell in cells[1].split(","))
        rows.append(Row(number, module[1], tests))
    return rows


@cache
def rows() -> list[Row]:
    return parse_table(PAGE.read_text())


# --- which modules are listed -----------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def only_re_exports(source: str) -> bool:
    """Whether a package's ``__init__.py`` holds no code: a docstring, imports, ``__all__``, a lazy ``__getattr__``."""
    for index, node in enumerate(ast.parse(source).body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not node.orelse:
            if all(isinstance(inner, ast.Import | ast.ImportFrom) for inner in node.body):
                continue
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["__all__"]:
            continue
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "__all__":
            continue
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            continue  # names loaded on first use
        return False
    return True


def modules_to_list() -> set[str]:
    """Every module of ``scheduler/`` the table must list, as a path from the repository's root."""
    found = set()
    for path in (ROOT / "scheduler").rglob("*.py"):
        relative = path.relative_to(ROOT)
        if "migrations" in relative.parts:
            continue
        if path.name == "__init__.py" and only_re_exports(path.read_text()):
            continue
        found.add(relative.as_posix())
    return found


# --- what names a module ----------------------------------------------------------------------------


def dotted(module: str) -> str:
    """``scheduler/owners/leases.py`` -> ``scheduler.owners.leases``; a package's ``__init__.py`` -> the package."""
    parts = list(Path(module).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _children(module: str) -> list[str]:
    """The submodules and subpackages of a package's ``__init__.py``; nothing for a plain module."""
    path = ROOT / module
    if path.name != "__init__.py":
        return []
    return sorted(
        child.stem if child.is_file() else child.name
        for child in path.parent.iterdir()
        if (child.suffix == ".py" and child.name != "__init__.py") or (child / "__init__.py").exists()
    )


def _re_exported(module: str) -> list[str]:
    """The names the module's package ``__init__.py`` imports from it (``Lease`` of ``scheduler.models.lease``)."""
    path = Path(module)
    package = ROOT / path.parent / "__init__.py"
    if path.name == "__init__.py" or not package.exists():
        return []
    return [
        alias.asname or alias.name
        for node in ast.walk(ast.parse(package.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == dotted(module)
        for alias in node.names
    ]


def _imported_from(package: str, name: str) -> str:
    """``from <package> import ..., <name>``, on one line or in parentheses."""
    return rf"from {re.escape(package)} import (?:\([^)]*|[^\n(]*?)\b{re.escape(name)}\b"


def markers(module: str) -> list[re.Pattern[str]]:
    """What in a test file's text names ``module``."""
    name = dotted(module)
    package, _, last = name.rpartition(".")
    found: list[str] = []
    if package:  # the top-level package's name starts every import of the app: it gets its markers below
        children = "|".join(map(re.escape, _children(module)))
        # The dotted name, not as the start of a submodule's (scheduler.outbox, not scheduler.outbox.broker)
        not_a_child = rf"(?!\.(?:{children})\b)(?! import (?:{children})\b)" if children else ""
        found.append(rf"(?<![\w.]){re.escape(name)}(?!\w){not_a_child}")
        found.append(_imported_from(package, last))
        for exported in _re_exported(module):
            found += [_imported_from(package, exported), rf"(?<![\w.]){re.escape(package)}[.:]{exported}\b"]
    path = Path(module)
    if path.parent == _COMMANDS and path.name != "__init__.py":
        command = re.escape(path.stem)
        found += [
            # call_command("<name>", ...), the suite's helpers (run, refused, cli, manage), partial(run, "<name>"),
            # or an argv list that starts with it
            rf"(?:\w\(\s*[\"']{command}[\"']\s*[,)]|partial\([\w.]+,\s*[\"']{command}[\"']\s*\)|\[\s*[\"']{command}[\"']\s*,)",
            rf"[\"']manage\.py[\"'],\s*[\"']{command}[\"']",
            rf"manage\.py {command}\b",
        ]
    found += [re.escape(marker) for marker in (*URLS.get(module, ()), *WIRED.get(module, ()))]
    return [re.compile(pattern) for pattern in found]


def names(text: str, module: str) -> bool:
    """Whether a test file's text names ``module`` by any of its markers."""
    return any(pattern.search(text) for pattern in markers(module))


# --- the checks -------------------------------------------------------------------------------------


def test_every_module_is_listed_exactly_once() -> None:
    # Given the modules of scheduler/ that hold code
    expected = modules_to_list()
    # When the table is read
    listed = Counter(row.module for row in rows())
    # Then each is listed, once
    missing = sorted(expected - set(listed))
    assert not missing, f"modules missing from {SECTION!r} in {PAGE.relative_to(ROOT)}:\n" + "\n".join(missing)
    twice = [f"{row.where()}: {row.module}" for row in rows() if listed[row.module] > 1]
    assert not twice, "modules listed more than once:\n" + "\n".join(twice)


def test_every_module_listed_exists_and_holds_code() -> None:
    # Given the modules the table must list
    expected = modules_to_list()
    # When the table is read
    # Then it lists no other path: a module removed or renamed, a migration, an __init__.py that only re-exports
    extra = [f"{row.where()}: {row.module}" for row in rows() if row.module not in expected]
    assert not extra, "listed but not a module of scheduler/ that holds code:\n" + "\n".join(extra)


def _is_test_file(path: str) -> bool:
    return path.startswith("tests/") and Path(path).name.startswith("test_") and (ROOT / path).is_file()


def test_every_row_lists_one_to_three_test_files_that_exist() -> None:
    # Given the table's rows ("none" is the UNTESTED modules' row, checked below)
    # When the test files each lists are looked up
    counts = [
        f"{row.where()}: {row.module} lists {len(row.tests)} test files, not 1 to 3"
        for row in rows()
        if len(row.tests) > 3 or (not row.tests and row.module not in UNTESTED)
    ]
    absent = [
        f"{row.where()}: {test} (for {row.module})" for row in rows() for test in row.tests if not _is_test_file(test)
    ]
    # Then each row lists one to three, and each is a test file of tests/ that exists
    assert not counts, "rows with too few or too many test files:\n" + "\n".join(counts)
    assert not absent, "test files listed that do not exist or are not test files:\n" + "\n".join(absent)


def test_only_the_untested_modules_say_none() -> None:
    # Given the modules no test exercises
    # When the table is read
    says_none = {row.module for row in rows() if not row.tests}
    # Then exactly those say "none"
    assert says_none <= UNTESTED, f"rows that say {NONE!r} for a module not in UNTESTED: {sorted(says_none - UNTESTED)}"
    assert UNTESTED <= says_none, f"UNTESTED modules whose row does not say {NONE!r}: {sorted(UNTESTED - says_none)}"


def test_every_test_file_listed_names_its_module() -> None:
    # Given each row's module and test files
    # When each test file's text is searched for the module's markers
    unnamed = [
        f"{row.where()}: {test} does not name {row.module}"
        for row in rows()
        for test in row.tests
        if (ROOT / test).is_file() and not names((ROOT / test).read_text(), row.module)
    ]
    # Then every one names it
    assert not unnamed, "test files that do not name the module they are listed for:\n" + "\n".join(unnamed)


def test_the_markers_name_each_form_and_nothing_else() -> None:
    # Given a module, a package with submodules, a re-exported model and a command
    leases, outbox, lease = "scheduler/owners/leases.py", "scheduler/outbox/__init__.py", "scheduler/models/lease.py"
    shards = "scheduler/management/commands/shards.py"
    # Then each form of naming them counts
    assert names("from scheduler.owners import executions, leases\n", leases)
    assert names("from scheduler.owners import (\n    executions,\n    leases,\n)\n", leases)
    assert names('monkeypatch.setattr("scheduler.owners.leases.acquire", fake)', leases)
    assert names("from scheduler import dbclock, outbox\n", outbox)
    assert names("from scheduler.outbox import publish_pending\n", outbox)
    assert names("from scheduler.models import Execution, Lease\n", lease)
    assert names('run("shards", "--set", "2")', shards)
    assert names('[sys.executable, "manage.py", "shards", "--json"]', shards)
    assert names("``manage.py shards --set N``", shards)
    # And what only looks like it does not
    assert not names("from scheduler.owners import executions\n", leases)
    assert not names("from scheduler.owners.leases_history import x\n", leases)
    assert not names("from scheduler.outbox import broker\n", outbox)
    assert not names("from scheduler.outbox.broker import revoke\n", outbox)
    assert not names("from scheduler.models import LeaseHandle\n", lease)
    assert not names('assert data["shards"] == 4', shards)


def test_an_init_that_only_re_exports_is_left_out() -> None:
    lazy = '"""Doc."""\nfrom __future__ import annotations\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import B\n__all__ = ["B"]\ndef __getattr__(name): ...\n'
    assert only_re_exports(lazy)
    assert only_re_exports("")
    assert not only_re_exports(lazy + "PUBLISH_BATCH = 500\n")
    assert not only_re_exports('"""Doc."""\ndef publish(app): ...\n')
