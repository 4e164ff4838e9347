"""Move the test database's schema to an older migration and back, for tests of data migrations."""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def migrate_to(targets: list[tuple[str, str]]) -> Any:
    """Migrate the test database to ``targets``; return the historical apps of that state."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def migrate_to_newest() -> None:
    """Migrate forward to the newest migrations, where every other test expects the schema to be."""
    migrate_to(MigrationExecutor(connection).loader.graph.leaf_nodes())
