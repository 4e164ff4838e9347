"""docs/adding-to-a-project.md, followed word for word: wheel, fresh virtualenv, fresh project, real processes.

The page's fenced blocks are the steps, read from the page itself so the
two cannot drift apart:

- a ``bash`` block: commands, run in order in the project's directory with
  the fresh virtualenv first on ``PATH``;
- a ``python`` block titled with a path: that file's content, written
  (``(append)`` in the title: added to the end of the file);
- the ``bash`` block titled ``run``: long-running processes, started in the
  background.

Two things are this test's own, not the page's: ``pip install`` takes the
wheel just built instead of the package index (with the lock as its
constraints), and on PostgreSQL the project's ``DATABASES`` points at a
fresh database of the suite's server (the page leaves the database to the
host). Then it adds a schedule of the user's task through the admin, as the
page's last step says, and checks its executions: each succeeded, one per
slot.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests
from django.db import connection

from tests.support.admin_forms import schedule_form
from tests.support.processes import CeleryProcess, wait_until
from tests.support.wheel import DISTRIBUTION, ROOT, build

pytestmark = pytest.mark.django_db(transaction=True)

PAGE = ROOT / "docs" / "adding-to-a-project.md"
BLOCK = re.compile(r'^```(?P<lang>\w+)(?: title="(?P<title>[^"]+)")?\n(?P<body>.*?)^```$', re.M | re.S)
PASSWORD = "add-to-project-Pw-9"
INSTALL_SECONDS = 600
SLOTS = 5


def steps() -> list[tuple[str, str | None, str]]:
    """The page's blocks in order: (language, title, body)."""
    return [(m["lang"], m["title"], m["body"]) for m in BLOCK.finditer(PAGE.read_text())]


def test_the_page_has_the_steps_this_test_follows() -> None:
    kinds = [(lang, title) for lang, title, _ in steps()]
    assert ("bash", None) in kinds and ("bash", "run") in kinds
    assert {title for lang, title in kinds if lang == "python"} >= {
        "billing/tasks.py",
        "mysite/settings.py (append)",
        "mysite/celery.py",
        "mysite/urls.py (append)",
    }


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    """Python for the fresh project's DATABASES on this run's database kind (empty: startproject's SQLite)."""
    if connection.vendor == "sqlite":
        yield ""
        return
    params = connection.settings_dict
    server = dict(host=params["HOST"], port=params["PORT"], user=params["USER"], password=params["PASSWORD"] or None)
    name = f"add_to_project_{tmp_path.name[-20:].lower().replace('-', '_')}"
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield (
            "\nDATABASES = {'default': {'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {name!r}, 'HOST': {server['host']!r}, 'PORT': {str(server['port'])!r}, "
            f"'USER': {server['user']!r}, 'PASSWORD': {server['password']!r}}}}}\n"
        )
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.timeout(INSTALL_SECONDS + 300)
def test_adding_to_a_project__as_the_page_says__runs_a_schedule_once_per_slot(
    tmp_path: Path, database: str, redis_url: str
) -> None:
    wheel = build(tmp_path / "wheel")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    project = tmp_path / "site"
    project.mkdir()
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "REDIS_URL": redis_url,
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        "PYTHONUNBUFFERED": "1",
    }

    def run(command: str, timeout: float = 300) -> str:
        argv = shlex.split(command)
        if argv[:2] == ["pip", "install"]:  # the wheel just built, at the lock's versions
            extra = "[postgresql]" if database else ""
            argv = [
                str(bin_dir / "pip"),
                "install",
                "--quiet",
                "-c",
                str(ROOT / "requirements.txt"),
                *[f"{wheel}{extra}" if arg == DISTRIBUTION else arg for arg in argv[2:]],
            ]
        done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    # A project that has never seen the scheduler, with the user's app
    run("pip install django-leader-beat", timeout=INSTALL_SECONDS)
    run("django-admin startproject mysite .")
    run("python manage.py startapp billing")
    if database:
        with (project / "mysite" / "settings.py").open("a") as settings:
            settings.write(database)

    # The page's steps, in order
    background: list[str] = []
    for lang, title, body in steps():
        if lang == "bash" and title == "run":
            background = [line for line in body.splitlines() if line.strip()]
        elif lang == "bash":
            for command in filter(str.strip, body.splitlines()):
                if command.startswith("pip install"):
                    continue  # done above, first: the other steps need the packages
                run(command)
        elif lang == "python" and title:
            path = project / title.removesuffix(" (append)")
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a" if title.endswith(" (append)") else "w") as file:
                file.write(("\n" if title.endswith(" (append)") else "") + body)

    port = _free_port()
    processes = []
    try:
        for n, command in enumerate(background):
            argv = shlex.split(command)
            if argv[-1] == "runserver":
                argv += [f"127.0.0.1:{port}", "--noreload"]
            argv[0] = str(bin_dir / argv[0]) if (bin_dir / argv[0]).exists() else argv[0]
            processes.append(CeleryProcess(f"p{n}", argv, env, tmp_path / f"p{n}.log", cwd=project).start())
        # The page's last step: a schedule of the user's task, added in the admin
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _answers(f"{base}/admin/login/"), timeout=60), processes[-1].log()[-3000:]
        _add_schedule_in_the_admin(base)
        # Then its executions succeed, one per slot, whichever beat leads
        rows = wait_until(lambda: _executions(run, at_least=SLOTS), timeout=90, interval=1)
        assert rows, f"fewer than {SLOTS} succeeded: {_executions(run, at_least=0)}\n{_logs(processes)}"
    finally:
        for process in processes:
            process.stop()
    # (the first slots: later ones may still have been running when the processes stopped)
    slots = [datetime.fromisoformat(row["scheduled_for"]) for row in rows]
    assert len(slots) == len(set(slots)), slots
    first = rows[:SLOTS]
    assert [row["status"] for row in first] == ["succeeded"] * SLOTS, f"{rows}\n{_logs(processes)}"
    assert [(b - a).total_seconds() for a, b in zip(slots, slots[1:SLOTS])] == [1.0] * (SLOTS - 1), slots


def _logs(processes: list[CeleryProcess]) -> str:
    return "\n".join(f"--- {p.name} {p.argv}\n{p.log()[-4000:]}" for p in processes)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _csrf(page: str) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)[1]  # type: ignore[index]


def _add_schedule_in_the_admin(base: str) -> None:
    browser = requests.Session()
    login = browser.get(f"{base}/admin/login/", timeout=10)
    done = browser.post(
        f"{base}/admin/login/?next=/admin/",
        data={"username": "admin", "password": PASSWORD, "csrfmiddlewaretoken": _csrf(login.text)},
        timeout=10,
    )
    assert "Log out" in done.text or "logout" in done.text, done.text[:2000]
    form = browser.get(f"{base}/admin/scheduler/schedule/add/", timeout=10)
    assert form.status_code == 200, form.text[:2000]
    fields = schedule_form(name="invoices", task="billing.send_invoices", interval="1")
    fields["csrfmiddlewaretoken"] = _csrf(form.text)
    saved = browser.post(f"{base}/admin/scheduler/schedule/add/", data=fields, timeout=10, allow_redirects=False)
    assert saved.status_code == 302, saved.text[:4000]


def _executions(run: Any, *, at_least: int) -> list[dict[str, Any]] | None:
    """The schedule's executions by slot, once ``at_least`` succeeded (read by the project's own shell)."""
    out = run(
        'python manage.py shell -c "import json; from scheduler.models import Execution; '
        "print(json.dumps([dict(scheduled_for=e.scheduled_for.isoformat(), status=e.status) "
        "for e in Execution.objects.filter(schedule__name='invoices').order_by('scheduled_for')]))\""
    )
    rows = json.loads(out.strip().splitlines()[-1])
    return rows if sum(row["status"] == "succeeded" for row in rows) >= at_least else None
