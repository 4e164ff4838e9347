"""Shared fixtures for the whole suite."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

from tests.support import quick_test_process
from tests.support.processes import ROOT, CeleryProcess, beat_argv, end_all, worker_argv

# --- services (test tooling; see tests/support/services.py and tests/suite.py) -------
# Other fixtures go below this section, not inside it.

_TESTS_DIR = Path(__file__).parent
#: directory under tests/ -> marker applied to every test collected there
_DIRECTORY_MARKERS = {"integration": "integration", "acceptance": "acceptance", "chaos": "chaos"}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to run when the database is not the one tests.suite asked for; leave the tests' own session unbounded.

    Also make this process's flush and password hashing the quicker ones (``tests.support.quick_test_process``).
    """
    _no_idle_bound_on_the_test_thread()
    quick_test_process.install()
    # tests.suite sets the label; if DATABASE_URL got lost on the way (a
    # wrapper script, a stray .env), the "PostgreSQL run" would quietly test
    # SQLite and pass. Fail the whole session instead.
    label = os.environ.get("SCHEDULER_TEST_DB_LABEL")
    if label and connection.vendor != label:
        raise pytest.UsageError(
            f"SCHEDULER_TEST_DB_LABEL={label} but the configured database is "
            f"{connection.vendor} ({settings.DATABASES['default']['ENGINE']}); "
            "is DATABASE_URL set for this run?"
        )


def _no_idle_bound_on_the_test_thread() -> None:
    """Keep ``session_limits``' idle-in-transaction bound off the session the tests run on, and on every other.

    A test that is not ``transaction=True`` runs inside one transaction, and
    its Python between two statements (building 20,000 rows on a loaded
    machine) may take longer than the bound: the server would end the
    session under it. The processes the tests start, and the threads a test
    starts, keep the bound.
    """
    from django.db.backends.signals import connection_created

    from scheduler.session_limits import bound_idle_transactions

    uid = "scheduler.session_limits.idle_transactions"

    def bound_off_the_test_thread(sender: object, connection: object, **kwargs: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            bound_idle_transactions(sender, connection, **kwargs)

    connection_created.disconnect(dispatch_uid=uid)
    connection_created.connect(bound_off_the_test_thread, dispatch_uid=uid, weak=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by directory, so `-m "not integration"` needs no decorators."""
    for item in items:
        try:
            top = item.path.relative_to(_TESTS_DIR).parts[0]
        except ValueError:  # collected from outside tests/
            continue
        if top in _DIRECTORY_MARKERS:
            item.add_marker(_DIRECTORY_MARKERS[top])


@pytest.fixture(scope="session")
def redis_url() -> str:
    """Return the Redis URL the app uses, after proving the server answers."""
    url: str = settings.REDIS_URL
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    error: Exception | None = None
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        error = exc  # failed outside the handler, so no chained tracebacks
    finally:
        client.close()
    if error is not None:
        # Fail, never skip (STYLE.md section 7): a skipped integration test
        # looks green on CI while proving nothing.
        pytest.fail(
            f"Redis is not reachable at {url}; run the suite with `make test` "
            f"(which starts one) or set REDIS_URL. ({error})",
            pytrace=False,
        )
    return url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """Yield a client on an empty Redis database, emptied again afterwards."""
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=5)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def db_vendor() -> str:
    """Return the database vendor under test: "sqlite" or "postgresql"."""
    return connection.vendor


# --- end of services section -------------------------------------------------


# --- processes -----------------------------------------------------------------


@pytest.fixture
def process_database_url(transactional_db: None) -> str:
    """Return a DATABASE_URL for child processes; commits are visible to them."""
    from tests.support.processes import test_database_url

    return test_database_url()


@pytest.fixture
def side_effect_table(transactional_db: None) -> Iterator[None]:
    """Create ``tests.support.tasks.SIDE_EFFECT_TABLE`` (no model) for this test; drop it afterwards.

    Request it before ``celery_processes``, so it is dropped after they stopped.
    """
    from tests.support.tasks import SIDE_EFFECT_TABLE

    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {SIDE_EFFECT_TABLE}")
        cursor.execute(f"CREATE TABLE {SIDE_EFFECT_TABLE} (execution_id bigint, attempt integer, pid integer)")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {SIDE_EFFECT_TABLE}")


@pytest.fixture
def process_env(process_database_url: str, redis_url: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_")}
    env.update(
        DATABASE_URL=process_database_url,
        REDIS_URL=redis_url,
        DJANGO_DEBUG="1",
        PYTHONUNBUFFERED="1",
        # The daily built-ins would fire into a test that runs at 03:17 or
        # 04:00 UTC and upset its counts; tests of them turn them back on.
        SCHEDULER_BUILTIN_SCHEDULES="0",
    )
    return env


@pytest.fixture
def celery_processes(
    process_env: dict[str, str], tmp_path: Path, redis_client: object
) -> Iterator[Callable[..., CeleryProcess]]:
    """Return ``start(kind, name, queues=None, concurrency=2, checkout=None, wrapper=None, **settings)``; all are stopped afterwards.

    ``checkout`` runs another release's code (a git worktree) with this
    virtualenv: the process starts there, with that directory first on its path.
    ``wrapper`` is a command the ``celery`` command line is appended to (it runs it in its own process).
    """
    started: list[CeleryProcess] = []

    def start(
        kind: str,
        name: str,
        *,
        queues: str | None = None,
        concurrency: int = 2,
        checkout: Path | None = None,
        wrapper: list[str] | None = None,
        **settings: object,
    ) -> CeleryProcess:
        env = dict(process_env)
        env.update({f"SCHEDULER_{key.upper()}": str(value) for key, value in settings.items()})
        if checkout is not None:
            env["PYTHONPATH"] = str(checkout)
        # An older release keeps the test tasks where it had them.
        old_layout = checkout is not None and (checkout / "tests" / "tasks.py").exists()
        tasks = "tests.tasks" if old_layout else "tests.support.tasks"
        argv = beat_argv() if kind == "beat" else worker_argv(name, concurrency=concurrency, queues=queues, tasks=tasks)
        process = CeleryProcess(
            name, [*(wrapper or []), *argv], env, tmp_path / f"{name}.log", cwd=checkout or ROOT
        ).start()
        started.append(process)
        return process

    yield start
    end_all(started)
