"""What every benchmark shares: its own services, a migrated database, tables and JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
PEERS_VENV = ROOT / "bench" / ".venv-peers"
PEERS_REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"
CELERY = str(Path(sys.executable).with_name("celery"))
MEASURED_DATABASES = ("postgresql", "sqlite")
#: Port 1: nothing answers there, for a benchmark that must never publish.
NO_BROKER_URL = "redis://127.0.0.1:1/0"
#: The beat replicas of the failover and shards benchmarks run with these, so that a takeover
#: takes seconds and both benchmarks measure it under the same lease.
LEASE_ENV = {
    "SCHEDULER_LEASE_TTL_SECONDS": "10",
    "SCHEDULER_LEASE_RENEW_SECONDS": "2",
    "SCHEDULER_FOLLOWER_RETRY_SECONDS": "1",
}


def machine() -> dict[str, Any]:
    """Describe the machine a result was measured on."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
    }


def print_load() -> list[float]:
    """Print the load average and return it: the machine may be shared, and the load says how much to trust a run."""
    load = [round(value, 2) for value in os.getloadavg()]
    print(f"load average (1, 5, 15 min): {load[0]}, {load[1]}, {load[2]}")
    return load


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def django_env(database_url: str, redis_url: str, var_dir: Path, *, debug: bool = True) -> dict[str, str]:
    """Return the environment for a child process that uses these services.

    ``debug=False`` runs the production settings (no query log), as a deployed beat does.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_")}
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        CELERY_BROKER_URL=redis_url,
        DJANGO_DEBUG="1" if debug else "",
        DJANGO_SETTINGS_MODULE="project.settings",
        VAR_DIR=str(var_dir),
        PYTHONUNBUFFERED="1",
    )
    if not debug:
        env.update(SECRET_KEY="bench-only-not-secret", ALLOWED_HOSTS="localhost", SECURE_SSL_REDIRECT="0")
    return env


def migrate(env: dict[str, str], python: str | Path = sys.executable) -> None:
    subprocess.run([str(python), "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)


class DatabaseServices(NamedTuple):
    """A scratch folder for logs, the Redis URL, and per database the environment of a child using it."""

    scratch: Path
    redis_url: str
    environments: dict[str, dict[str, str]]


@contextmanager
def migrated_databases(
    databases: Sequence[str], *, broker: bool = True, debug: bool = False
) -> Iterator[DatabaseServices]:
    """Start Redis (a URL nothing answers on without ``broker``) and each database named, migrated; stop them after."""
    import tempfile
    from contextlib import ExitStack

    from tests.support.services import postgres_cluster, redis_server

    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-")))
        redis_url = stack.enter_context(redis_server()) if broker else NO_BROKER_URL
        postgres_url = stack.enter_context(postgres_cluster()) if "postgresql" in databases else ""
        environments = {}
        for database in databases:
            var_dir = scratch / database
            var_dir.mkdir()
            url = postgres_url if database == "postgresql" else f"sqlite:///{var_dir / 'bench.sqlite3'}"
            environments[database] = django_env(url, redis_url, var_dir, debug=debug)
            migrate(environments[database])
        yield DatabaseServices(scratch, redis_url, environments)


@contextmanager
def migrated_services(*, broker: bool = True, debug: bool = False) -> Iterator[tuple[dict[str, str], Path]]:
    """Start the benchmark's own PostgreSQL (and Redis, with ``broker``), migrated; stop them afterwards.

    Yields the environment of a child process using them (see ``django_env``)
    and a scratch folder for its logs.
    """
    with migrated_databases(["postgresql"], broker=broker, debug=debug) as services:
        yield services.environments["postgresql"], services.scratch


def add_databases_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--databases``, the comma-separated databases to measure on (a list once parsed), both by default."""
    parser.add_argument(
        "--databases",
        type=_database_names,
        default=",".join(MEASURED_DATABASES),
        help="comma-separated: postgresql, sqlite",
    )


def _database_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(MEASURED_DATABASES):
        raise argparse.ArgumentTypeError("takes postgresql and/or sqlite")
    return names


def child_command(module: str, **options: Any) -> list[str]:
    """Return the command running ``python -m <module> --child`` with these options as ``--name=value``."""
    command = [sys.executable, "-m", module, "--child"]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        # A switch: given when on; an option not wanted this run: left out.
        if value is True:
            command.append(flag)
        elif value is not None and value is not False:
            command.append(f"{flag}={value}")
    return command


def measure_in_child(module: str, **options: Any) -> Any:
    """Run a benchmark's child on its own PostgreSQL and Redis, with ``--logs`` their scratch folder; return its result."""
    with migrated_services() as (env, scratch):
        return run_child(child_command(module, logs=scratch, **options), env)


def run_child(command: Sequence[str], env: dict[str, str]) -> Any:
    """Run a benchmark's measuring child (``python -m bench.<name> --child ...``) and return its result.

    The child prints its progress to stderr and its result as JSON on the
    last line of stdout; a child that fails raises ``CalledProcessError``.
    """
    child = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def peers_python() -> Path:
    """Return the Python of ``bench/.venv-peers``, (re)installing it when the requirements changed.

    The peers (django-celery-beat, celery-redbeat) never enter the project's
    environment: they are installed from ``requirements.txt`` plus
    ``bench/requirements-peers.txt`` into their own virtualenv.
    """
    python = PEERS_VENV / "bin" / "python"
    stamp = PEERS_VENV / "requirements.stamp"
    wanted = (ROOT / "requirements.txt").read_text() + PEERS_REQUIREMENTS.read_text()
    if not python.exists() or not stamp.exists() or stamp.read_text() != wanted:
        print(f"installing the peers into {PEERS_VENV.relative_to(ROOT)} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "-r",
                str(ROOT / "requirements.txt"),
                "-r",
                str(PEERS_REQUIREMENTS),
            ],
            check=True,
        )
        stamp.write_text(wanted)
    return python


def insert_generated(model: Any, count: int, expressions: dict[str, str], *, table: str | None = None) -> None:
    """INSERT ``count`` rows of ``model`` built by ``generate_series`` (``g`` = 1..count), server side.

    Columns not in ``expressions`` get the field's Python default as a
    parameter. ``table`` inserts into another table of the same shape.
    """
    from django.db import connection

    columns, values, params = [], [], []
    for field in model._meta.concrete_fields:
        if field.primary_key:
            continue
        columns.append(connection.ops.quote_name(field.column))
        if field.attname in expressions:
            values.append(expressions[field.attname].replace("%", "%%"))  # literal % (modulo) in SQL
            continue
        default = field.get_default()
        if field.get_internal_type() == "JSONField":
            values.append("%s::jsonb")
            params.append(json.dumps(default))
        else:
            values.append("%s")
            params.append(default)
    sql = (
        f"INSERT INTO {table or model._meta.db_table} ({', '.join(columns)}) "
        f"SELECT {', '.join(values)} FROM generate_series(1, {int(count)}) AS g"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


#: Generated schedules of the at-scale benchmarks (admin pages, ``/metrics``): 50 tasks, every
#: 1 to 11 minutes over five queues, one in ten disabled, due within the hour, a mix of last outcomes.
_SCALE_SCHEDULE_COLUMNS = {
    "name": "'schedule-' || g",
    "task": "'app.task_' || (g % 50)",
    "interval": "60 + (g % 600)",
    "queue": "'queue-' || (g % 5)",
    "enabled": "(g % 10 <> 0)",
    "next_run_at": "now() + make_interval(secs => g % 3600)",
    "last_run_at": "now() - make_interval(secs => g % 3600)",
    "last_status": "(ARRAY['succeeded','failed','timed_out'])[1 + g % 3]",
    "created_at": "now()",
    "updated_at": "now()",
}


def _scale_execution_columns(schedules: int) -> dict[str, str]:
    """Return the generated executions' columns the at-scale benchmarks share: spread over ``schedules`` rows."""
    return {
        "idempotency_key": "'bench:' || g",
        "schedule_id": f"(SELECT min(id) FROM scheduler_schedule) + (g % {schedules})",
        "task": "'app.task_' || (g % 50)",
        "celery_task_id": "md5(g::text)",
    }


def insert_scale_schedules(count: int, columns: dict[str, str]) -> float:
    """Insert ``count`` generated schedules, ``columns`` over the shared ones; return the seconds it took."""
    from scheduler.models import Schedule

    started = time.monotonic()
    insert_generated(Schedule, count, {**_SCALE_SCHEDULE_COLUMNS, **columns})
    return time.monotonic() - started


def insert_scale_executions(count: int, schedules: int, columns: dict[str, str]) -> None:
    """Insert ``count`` generated executions spread over ``schedules`` schedules, ``columns`` over the shared ones."""
    from scheduler.models import Execution

    insert_generated(Execution, count, {**_scale_execution_columns(schedules), **columns})


def add_scale_arguments(parser: argparse.ArgumentParser, *, repeat: int, repeat_help: str) -> None:
    """Add an at-scale benchmark's options: the rows to load, ``--repeat`` measurements, and the child's switch."""
    parser.add_argument("--schedules", type=int, default=1_000_000)
    parser.add_argument("--executions", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=repeat, help=repeat_help)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def measure_at_scale(module: str, schedules: int, executions: int, repeat: int) -> Any:
    """Run an at-scale benchmark's child, which loads the rows and renders pages, on a PostgreSQL of its own."""
    with migrated_services(broker=False, debug=True) as (env, _):  # rendering a page never touches the broker
        env["ALLOWED_HOSTS"] = "testserver"
        print(f"loading {schedules:,} schedules and {executions:,} executions into PostgreSQL...", flush=True)
        return run_child(child_command(module, schedules=schedules, executions=executions, repeat=repeat), env)


def execute_sql(sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on Django's connection; return its rows (none for a statement without)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def log_to_file(path: Path) -> None:
    """Send this process's ``scheduler`` log lines to ``path`` instead of the console."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.getLogger("scheduler").handlers = [handler]


# --- measuring a process ----------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """Return the user + system CPU seconds a process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """Return a process's peak resident memory so far (``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def stop_process(process: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM a process started with ``start_new_session=True``; SIGKILL its group if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def percentile(values: Sequence[float], q: float) -> float | None:
    """Return the ``q``-th percentile (nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def progress(message: str) -> None:
    """Print a line of a benchmark's progress to stderr (stdout of a child carries its result)."""
    print(message, file=sys.stderr, flush=True)


def whole_numbers(text: str) -> list[int]:
    """Return the comma-separated whole numbers of an option such as ``--replicas 1,2,4``."""
    return [int(part) for part in text.split(",") if part.strip()]


def dash_if_none(value: Any) -> Any:
    """Return a table cell for ``value``: ``-`` where nothing was measured."""
    return "-" if value is None else value


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render rows as a plain-text table with right-aligned numbers."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "-" * len(line)]
    for row in cells:
        out.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").isdigit()


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with the machine and time of the run, and say where."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "measured_at": datetime.now(timezone.utc).isoformat(),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return path
