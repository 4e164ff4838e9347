"""Multi-row INSERT of model instances that ignores conflicts, without Django's per-row field preparation.

``QuerySet.bulk_create`` passes every value of every row through its field
(``pre_save``, then ``get_db_prep_save``): on a table as wide as
``scheduler_execution`` that is some 60 calls per row, nearly all of which
hand the value back unchanged, and it was the largest part of the leader's
dispatch commit. Here each column is worked out once per model and
database: a value its field would hand back unchanged skips the field
(``None`` in any column, a ``str`` in a text one, an ``int`` in an integer
one, a ``bool`` in a boolean one, an aware datetime where the database
driver takes it as it is); any other value (a JSON value, a datetime on
SQLite) still goes through ``get_db_prep_save``; only fields that fill
themselves in run ``pre_save``. So the rows written are those
``bulk_create(objs, ignore_conflicts=True)`` writes, with one difference: a
field that fills itself in with the time (``auto_now``, ``auto_now_add``)
takes the database's clock, in the statement itself (no round trip), as
every other time of a row's life does, never this process's clock.

Only a conflict on the one unique column named (``key``) is ignored, by
``ON CONFLICT (key) DO NOTHING``: any other broken constraint (NOT NULL,
CHECK, another unique one) raises, as it would for ``save()``. SQLite's
``INSERT OR IGNORE``, which ``bulk_create(ignore_conflicts=True)`` writes
there, would drop such a row silently instead. ``RETURNING key`` tells which
rows were stored, so a caller counts only those.

PostgreSQL gets one ``INSERT ... SELECT * FROM unnest(%b::type[], ...)`` per
batch: the statement Django builds itself, but with the arrays sent as
binary parameters, which psycopg builds in about a third of the time it
takes to quote them into the SQL text as Django's client-side cursor does.
SQLite (3.35+, for ``RETURNING``) gets one multi-row ``INSERT ... VALUES``
per batch, as many rows as its limit on parameters allows.

Mirrors, checked against Django 5.2.19 and psycopg 3.3.9 (``requirements.txt``):

- ``QuerySet.bulk_create`` and ``SQLInsertCompiler.as_sql``,
  ``prepare_value``, ``pre_save_val`` (``django/db/models/query.py``,
  ``django/db/models/sql/compiler.py``): which fields are written, and each
  value through ``pre_save`` and ``get_db_prep_save``; ``Field.generated``,
  ``Field.db_default``;
- ``SQLInsertCompiler.as_sql`` of the PostgreSQL backend
  (``django/db/backends/postgresql/compiler.py``): its ``UNNEST`` insert;
- ``Model._prepare_related_fields_for_save`` (``django/db/models/base.py``);
- ``DatabaseOperations.adapt_datetimefield_value`` of each backend;
- a server-binding cursor that Django logs and checks as its own, never
  preparing its statement (a batch's statement is rarely run twice), from
  ``scheduler/fastpath/cursors.py``, which names what it mirrors.

Self-check (``FAST_PATH``): the first insert in a process also prepares its
first ``CHECKED_ROWS`` rows as ``bulk_create`` does, every column through
its field, and the values must be those the fast path sends. A difference,
or an internal gone or changed, inserts by ``bulk_create`` from then on.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import chain
from operator import attrgetter
from typing import Any, cast

from django.db import IntegrityError, connections, models, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import DateField, Field, Model
from django.db.models.fields import NOT_PROVIDED
from django.db.models.functions import Now
from django.db.models.sql import Query

from scheduler.fastpath import cursors
from scheduler.fastpath.guard import BREAKAGE, FastPath, comparable

#: Whether this process inserts by its own statement; else by ``bulk_create`` (``_insert_by_bulk_create``).
FAST_PATH = FastPath("bulk_insert", slow_path="bulk_create, one savepoint per batch")
#: Rows of the first insert in a process whose prepared values are compared with ``bulk_create``'s.
CHECKED_ROWS = 100

#: Django's fields whose ``get_db_prep_save`` returns a value of this Python type as it is
#: (``str`` subclasses such as ``TextChoices`` members included; ``int`` ones, ``bool``, not).
#: Exact classes: a subclass may prepare its values its own way.
_STORED_AS_IS: dict[type[Field], type] = {
    models.CharField: str,
    models.TextField: str,
    models.BooleanField: bool,
    models.SmallIntegerField: int,
    models.IntegerField: int,
    models.BigIntegerField: int,
    models.PositiveSmallIntegerField: int,
    models.PositiveIntegerField: int,
    models.PositiveBigIntegerField: int,
    models.SmallAutoField: int,
    models.AutoField: int,
    models.BigAutoField: int,
}


class _Never:
    """A type no value has: every value of the column goes through its field."""


@dataclass(frozen=True)
class _Column:
    field: Field
    #: Values of this type are written as they are (``str``: its subclasses too; ``datetime``: aware ones).
    as_is: type
    #: ``pre_save`` computes the value (``auto_now``, ``auto_now_add``), as it does for ``bulk_create``.
    fills_itself: bool


@dataclass(frozen=True, eq=False)  # one per model, database and key (``_statement``): hashed by identity
class _Statement:
    #: The columns whose values are sent, in the order of ``head``.
    columns: tuple[_Column, ...]
    #: ``, <database clock>`` for each column after those (``auto_now``, ``auto_now_add``), in every row.
    clock: str
    #: ``INSERT INTO table (columns)``; the rows follow.
    head: str
    #: ``ON CONFLICT (key) DO NOTHING RETURNING key``, after the rows.
    tail: str
    #: PostgreSQL: the whole statement, every row's values as one array per column (``unnest``);
    #: empty where each row is a ``VALUES`` tuple (``_values_sql``).
    by_column: str


@functools.lru_cache(maxsize=16)
def _values_sql(statement: _Statement, rows: int) -> str:
    """Return ``statement`` with ``rows`` rows of placeholders (a full batch's is built once)."""
    row = "(" + ", ".join(["%s"] * len(statement.columns)) + statement.clock + ")"
    return f"{statement.head} VALUES {', '.join([row] * rows)} {statement.tail}"


def insert_ignoring_conflicts(objs: Sequence[Model], *, key: str, batch_size: int) -> list[Any]:
    """Insert the unsaved instances ``objs`` (all of one model) but those whose ``key`` is stored; return the keys stored.

    ``key`` names a unique field: a row whose value of it is taken is skipped
    (``ON CONFLICT (key) DO NOTHING``); any other constraint the row breaks
    raises ``IntegrityError``. Returns the ``key`` values of the rows this
    call stored (the database's ``RETURNING``), in no particular order.

    Writes what ``bulk_create(objs, ignore_conflicts=True)`` writes and, like
    it, sets no primary key, sends no signals and raises ``ValueError`` for
    an unsaved related object; unlike it, ``auto_now`` and ``auto_now_add``
    fields are the database's clock and are not filled in on the instances.
    Values must be values, not expressions.
    """
    if not objs:
        return []
    model = type(objs[0])
    if any(obj.pk is not None for obj in objs):
        raise ValueError("insert_ignoring_conflicts() takes unsaved instances only (no primary key)")
    alias = router.db_for_write(model)
    if not FAST_PATH.fallen:
        try:
            plan = _plan(objs, alias, key, batch_size)
        except _NotAValue:
            raise  # the caller's mistake, not a broken internal
        except BREAKAGE as exc:
            FAST_PATH.fall_back(f"preparing an insert raised {exc!r}", exc)
        else:
            with plan.cursor as cursor:
                if FAST_PATH.check_once(lambda: _difference(objs[:CHECKED_ROWS], plan.statement, alias)):
                    return _run(plan, cursor, alias)
    return _insert_by_bulk_create(objs, alias, key, batch_size)


class _NotAValue(TypeError):
    """An expression where the insert takes values."""


@dataclass(frozen=True)
class _Plan:
    """An insert worked out before any of it runs (a broken internal raises here, not halfway)."""

    statement: _Statement
    #: (SQL, parameters) of each batch.
    batches: list[tuple[str, list[Any]]]
    cursor: CursorWrapper


def _plan(objs: Sequence[Model], alias: str, key: str, batch_size: int) -> _Plan:
    connection = connections[alias]
    statement = _statement(type(objs[0]), alias, connection.vendor, key)
    for column in statement.columns:
        if column.field.is_relation:
            _check_related(objs, cast("models.ForeignKey[Any, Any]", column.field))
    batches: list[tuple[str, list[Any]]] = []
    if statement.by_column:
        for start in range(0, len(objs), batch_size):
            batch = objs[start : start + batch_size]
            batches.append((statement.by_column, [_values(batch, column, connection) for column in statement.columns]))
        return _Plan(statement, batches, cursors.binding_cursor(connection, prepare=False))
    size = max(1, min(batch_size, _parameters_limit(connection) // len(statement.columns)))
    for start in range(0, len(objs), size):
        batch = objs[start : start + size]
        columns = [_values(batch, column, connection) for column in statement.columns]
        batches.append((_values_sql(statement, len(batch)), list(chain.from_iterable(zip(*columns)))))
    return _Plan(statement, batches, connection.cursor())


def _run(plan: _Plan, cursor: CursorWrapper, alias: str) -> list[Any]:
    stored: list[Any] = []
    with transaction.atomic(using=alias, savepoint=False):
        for sql, params in plan.batches:
            cursor.execute(sql, params)
            stored += [row[0] for row in cursor.fetchall()]
    return stored


def _difference(objs: Sequence[Model], statement: _Statement, alias: str) -> str | None:
    """The first value the fast path sends that ``bulk_create``'s field preparation would not; ``None``: alike."""
    connection = connections[alias]
    for column in statement.columns:
        field = column.field
        fast = _values(objs, column, connection)
        slow = [field.get_db_prep_save(field.pre_save(obj, True), connection) for obj in objs]
        for sent, prepared in zip(fast, slow, strict=True):
            if comparable(sent) != comparable(prepared):
                return f"{field.name}: {sent!r} where bulk_create sends {prepared!r}"
    return None


def _insert_by_bulk_create(objs: Sequence[Model], alias: str, key: str, batch_size: int) -> list[Any]:
    """The slow path: ``bulk_create`` a batch at a time in a savepoint, row by row in a batch that meets a conflict.

    Stores the same rows, but ``auto_now`` and ``auto_now_add`` fields take
    this process's clock, and the instances stored get their primary key.
    """
    model = type(objs[0])
    rows = model._base_manager.db_manager(alias)
    attname = cast("Field[Any, Any]", model._meta.get_field(key)).attname
    stored: list[Any] = []
    for start in range(0, len(objs), batch_size):
        batch = objs[start : start + batch_size]
        try:
            with transaction.atomic(using=alias):
                rows.bulk_create(batch)
        except IntegrityError:
            for obj in batch:
                try:
                    with transaction.atomic(using=alias):
                        rows.bulk_create([obj])
                except IntegrityError:
                    if not rows.filter(**{attname: getattr(obj, attname)}).exists():
                        raise  # not a taken key: another constraint
                else:
                    stored.append(getattr(obj, attname))
        else:
            stored += [getattr(obj, attname) for obj in batch]
    return stored


@functools.cache
def _statement(model: type[Model], alias: str, vendor: str, key: str) -> _Statement:
    """Work out the columns and the statement once per model, database and key (``vendor`` keys the cache)."""
    connection = connections[alias]
    opts = model._meta
    fields = [field for field in opts.concrete_fields if not field.generated and not field.primary_key]
    for field in fields:
        if field.db_default is not NOT_PROVIDED:
            raise ValueError(
                f"{opts.label}.{field.name} has a db_default, which insert_ignoring_conflicts() does not write"
            )
    unique = opts.get_field(key)
    if not isinstance(unique, Field) or not unique.unique:
        raise ValueError(
            f"{opts.label}.{key} is not unique: insert_ignoring_conflicts() ignores conflicts on a unique key"
        )
    quote = connection.ops.quote_name
    # Fields that fill themselves in with the time take the database's clock (the ORM's ``Now()``), last.
    clocked: list[Field[Any, Any]] = [
        field for field in fields if isinstance(field, models.DateTimeField) and (field.auto_now or field.auto_now_add)
    ]
    fields = [field for field in fields if field not in clocked] + clocked
    now_sql, _ = Query(model).get_compiler(alias).compile(Now())
    clock = "".join(f", {now_sql}" for _ in clocked)
    columns = tuple(_column(field, connection) for field in fields if field not in clocked)
    names = ", ".join(quote(field.column) for field in fields)
    head = f"INSERT INTO {quote(opts.db_table)} ({names})"
    tail = f"ON CONFLICT ({quote(unique.column)}) DO NOTHING RETURNING {quote(unique.column)}"
    by_column = ""
    if vendor == "postgresql":
        # As Django's own UNNEST insert: the type without its length (varchar[], not varchar(255)[]).
        arrays = ", ".join(f"(%b)::{(column.field.db_type(connection) or '').split('(')[0]}[]" for column in columns)
        by_column = f"{head} SELECT *{clock} FROM unnest({arrays}) {tail}"
    return _Statement(columns, clock, head, tail, by_column)


def _parameters_limit(connection: BaseDatabaseWrapper) -> int:
    """Return how many parameters one statement takes (SQLite: the library's own limit, not Django's 999)."""
    connection.ensure_connection()
    if connection.vendor == "sqlite":
        return connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    return connection.features.max_query_params or 65_535


def _column(field: Field, connection: BaseDatabaseWrapper) -> _Column:
    stored = cast("models.ForeignKey[Any, Any]", field).target_field if field.is_relation else field
    as_is = _STORED_AS_IS.get(type(stored), _Never)
    if type(field) is models.DateTimeField:
        # An aware datetime passes the field unchanged; then it is up to the database's adapter.
        probe = datetime(2000, 1, 1, tzinfo=timezone.utc)
        adapted: object = connection.ops.adapt_datetimefield_value(probe)  # the stubs say str | None
        as_is = datetime if adapted is probe else _Never
    # Field.pre_save returns the attribute; DateField's too unless auto_now(_add) is set.
    overridden = type(field).pre_save is not Field.pre_save
    plain_date = isinstance(field, DateField) and not (field.auto_now or field.auto_now_add)
    return _Column(field, as_is, fills_itself=overridden and not plain_date)


def _check_related(objs: Sequence[Model], field: models.ForeignKey[Any, Any]) -> None:
    """Raise for an unsaved related object, or take the id of one saved since its assignment, as bulk_create does."""
    attname = field.attname
    for obj in objs:
        # A row whose id is set needs nothing: bulk_create would only tidy its cache.
        if getattr(obj, attname) is None and field.is_cached(obj):
            # Django's private step of bulk_create, not in the stubs.
            obj._prepare_related_fields_for_save(operation_name="bulk_create")  # type: ignore[attr-defined]  # noqa: SLF001


def _values(objs: Sequence[Model], column: _Column, connection: BaseDatabaseWrapper) -> list[Any]:
    field = column.field
    if column.fills_itself:
        raw = [field.pre_save(obj, True) for obj in objs]
    else:
        raw = list(map(attrgetter(field.attname), objs))
    as_is = column.as_is

    # An empty list or dict (a JSON column's usual default) is prepared once per column.
    empties: dict[type, Any] = {}

    def prepared(value: Any) -> Any:
        kind = type(value)
        if (kind is list or kind is dict) and not value:
            if kind not in empties:
                empties[kind] = field.get_db_prep_save(value, connection)
            return empties[kind]
        if hasattr(value, "resolve_expression"):
            raise _NotAValue(f"insert_ignoring_conflicts() takes values, not expressions: {field.name}={value!r}")
        return field.get_db_prep_save(value, connection)

    # Three spellings of one test, to keep the per-value work to a comparison.
    if as_is is str:
        return [value if value is None or isinstance(value, str) else prepared(value) for value in raw]
    if as_is is datetime:
        return [
            value
            if value is None or (isinstance(value, datetime) and value.utcoffset() is not None)
            else prepared(value)
            for value in raw
        ]
    return [value if value is None or type(value) is as_is else prepared(value) for value in raw]
