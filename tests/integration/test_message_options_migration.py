"""Migrations 0026 and 0032: the release before 0026 can write schedules all through a ``migrate``, and after it.

0026 adds the message options (``headers``, ``exchange``, ``routing_key``)
with database defaults, so an ``INSERT`` naming none of them works from the
moment they exist; 0032 gives them their defaults in a database that ran an
earlier 0026, which added them without.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from tests.support.schema_migrations import migrate_to, migrate_to_newest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE_0026 = ("scheduler", "0025_notifications")
OPTIONS = ("exchange", "headers", "routing_key")


def older_release_schedule() -> Any:
    """The schedule model as the release before 0026 knows it: its inserts name none of the message options."""
    return MigrationExecutor(connection).loader.project_state(BEFORE_0026).apps.get_model("scheduler", "Schedule")


def stored_options(name: str) -> tuple[Any, ...]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(OPTIONS)} FROM scheduler_schedule WHERE name = %s", [name])
        return cursor.fetchone()


def test_0026__the_older_release_writes_a_schedule_right_after_it(back_to_newest: None) -> None:
    # Given a database migrated to 0026 and no further (the seconds before 0032 in one migrate)
    migrate_to([BEFORE_0026])
    migrate_to([("scheduler", "0026_incidents_check_ins_message_options")])

    # When the older release saves a schedule
    older_release_schedule().objects.create(name="older", task="scheduler.echo", interval=60)

    # Then the columns it does not know take their defaults
    assert stored_options("older") in [("", "{}", ""), ("", {}, "")]


def test_0032__gives_the_defaults_to_a_database_that_ran_an_earlier_0026(back_to_newest: None) -> None:
    # Given a database whose message options have no database default, as the first 0026 left them
    migrate_to([("scheduler", "0031_drop_queued_index")])
    state = MigrationExecutor(connection).loader.project_state(("scheduler", "0031_drop_queued_index"))
    model = state.apps.get_model("scheduler", "Schedule")
    with connection.schema_editor() as editor:
        for name in OPTIONS:
            with_default = model._meta.get_field(name)
            _, _, args, kwargs = with_default.deconstruct()
            del kwargs["db_default"]
            without = type(with_default)(*args, **kwargs)
            without.set_attributes_from_name(name)
            without.model = model
            editor.alter_field(model, with_default, without)
    with pytest.raises(Exception, match="(?i)null|not null"):
        older_release_schedule().objects.create(name="refused", task="scheduler.echo", interval=60)

    # When 0032 runs
    migrate_to_newest()

    # Then the older release's schedule is written, with the defaults
    older_release_schedule().objects.create(name="older", task="scheduler.echo", interval=60)
    assert stored_options("older") in [("", "{}", ""), ("", {}, "")]
