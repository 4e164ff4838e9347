"""Fixtures that run real beat and worker processes against the test database."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tests.processes import CeleryProcess, beat_argv, worker_argv


@pytest.fixture
def process_env(process_database_url: str, redis_url: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_")}
    env.update(
        DATABASE_URL=process_database_url,
        REDIS_URL=redis_url,
        DJANGO_DEBUG="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def celery_processes(
    process_env: dict[str, str], tmp_path: Path, redis_client: object
) -> Iterator[Callable[..., CeleryProcess]]:
    """Return ``start(kind, name, queues=None, concurrency=2, **settings)``; all are stopped afterwards."""
    started: list[CeleryProcess] = []

    def start(
        kind: str, name: str, *, queues: str | None = None, concurrency: int = 2, **settings: object
    ) -> CeleryProcess:
        env = dict(process_env)
        env.update({f"SCHEDULER_{key.upper()}": str(value) for key, value in settings.items()})
        argv = beat_argv() if kind == "beat" else worker_argv(name, concurrency=concurrency, queues=queues)
        process = CeleryProcess(name, argv, env, tmp_path / f"{name}.log").start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
