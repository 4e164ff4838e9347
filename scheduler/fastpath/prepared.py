"""ORM statements compiled once per process and run again with new values: the worker's per-task writes.

Django compiles a queryset to SQL on every call, and for the guard's claim
and finish that costs several times what the database does for them
(``python -m bench.worker_overhead --profile``). A ``Prepared`` statement is
built from the ORM as usual, once per database and variant, with ``Param``
expressions standing where the values of a call go; a call puts its values,
adapted by the column's field as the ORM would, in their place and runs the
same SQL. The SQL is the ORM's own, so both databases get what they always
got.

Mirrors, checked against Django 5.2.19 (``requirements.txt``):

- ``SQLCompiler.compile`` and ``SQLUpdateCompiler.as_sql`` /
  ``SQLInsertCompiler.as_sql`` (``django/db/models/sql/compiler.py``): that
  the parameters an expression's ``as_sql`` returns reach the statement's
  parameters as they are, so a ``Param`` can stand for a later value;
- ``SQLCompiler.get_converters`` (``connection.ops.get_db_converters`` and
  ``Expression.get_db_converters``) and ``Model.from_db``
  (``django/db/models/base.py``): how a row becomes an instance
  (``RowReader``).

Self-check (``FAST_PATH``): each statement, when first compiled in a
process, is compiled a second time with the call's values in place of the
``Param`` objects (what compiling the queryset per call gives), and SQL and
parameters must be equal; the first row ``RowReader`` reads is read again
by the ORM and must be equal. A difference, or an internal gone or changed,
compiles every statement per call from then on, and reads a row returned
by a statement again by its primary key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Expression, Field, Model
from django.db.models.sql.compiler import SQLCompiler

from scheduler.fastpath import cursors
from scheduler.fastpath.guard import BREAKAGE, FastPath, comparable

#: Whether this process runs statements compiled once; else the ORM compiles each per call.
FAST_PATH = FastPath("prepared", slow_path="the ORM compiling each statement per call")

#: A call's values while its statement is compiled with them in place (the slow path), else ``None``.
_INLINE: ContextVar[dict[str, Any] | None] = ContextVar("prepared_inline", default=None)


class Param(Expression):
    """Where a call's value ``name`` goes: compiles to one placeholder, adapted per call by ``output_field``."""

    def __init__(self, name: str, output_field: Field) -> None:
        super().__init__(output_field=output_field)
        self.name = name

    def as_sql(self, compiler: SQLCompiler, connection: Any) -> tuple[str, list[Any]]:
        return "%s", [self.parameter(connection)]

    def parameter(self, connection: Any) -> Any:
        """What its placeholder's parameter is in a statement built now: itself, or the call's value inlined."""
        values = _INLINE.get()
        if values is None:
            return self
        return self.output_field.get_db_prep_save(values[self.name], connection)


@contextmanager
def _inlined(values: dict[str, Any]) -> Iterator[None]:
    token = _INLINE.set(values)
    try:
        yield
    finally:
        _INLINE.reset(token)


class Prepared:
    """One statement, compiled on first use per database and variant; ``execute`` runs it with new values.

    ``build(using, *variant)`` returns the statement's ``(sql, params)`` as
    the ORM compiles it, with ``Param`` objects among the params. The variant
    (a status, a setting's value) may change the SQL; ``Param`` values do not.
    """

    def __init__(self, build: Callable[..., tuple[str, list[Any]]]) -> None:
        self._build = build
        self._compiled: dict[tuple[Hashable, ...], tuple[str, list[Any]]] = {}

    def execute(self, using: str, variant: tuple[Hashable, ...], values: dict[str, Any]) -> Any:
        """Run the statement; return its first row when it returns rows, else how many rows it changed."""
        if not FAST_PATH.fallen:
            key = (using, *variant)
            try:
                compiled = self._compiled.get(key)
                fresh = compiled is None
                if compiled is None:  # two threads may both compile it: the same result
                    compiled = self._build(using, *variant)
                sql, params = compiled[0], self._params(compiled[1], values, using)
            except BREAKAGE as exc:
                # A value no statement takes fails the ORM alike (raised from here):
                # only a fast path failing alone is broken.
                with _inlined(values):
                    sql, params = self._build(using, *variant)
                FAST_PATH.fall_back(f"compiling or filling in a statement raised {exc!r}", exc)
                return _run(using, sql, params, prepare=False)
            else:
                if not fresh or FAST_PATH.check(lambda: self._difference(sql, params, using, variant, values)):
                    self._compiled[key] = compiled
                    return _run(using, sql, params, prepare=True)
        with _inlined(values):
            sql, params = self._build(using, *variant)
        return _run(using, sql, params, prepare=False)

    def _params(self, template: list[Any], values: dict[str, Any], using: str) -> list[Any]:
        connection = connections[using]
        return [
            param.output_field.get_db_prep_save(values[param.name], connection) if isinstance(param, Param) else param
            for param in template
        ]

    def _difference(
        self, sql: str, params: list[Any], using: str, variant: tuple[Hashable, ...], values: dict[str, Any]
    ) -> str | None:
        """How the statement filled in differs from the ORM's compiled with the values in place; ``None``: alike."""
        with _inlined(values):
            orm_sql, orm_params = self._build(using, *variant)
        if sql != orm_sql:
            return f"the SQL compiled once is {sql!r}, compiled per call {orm_sql!r}"
        if list(map(comparable, params)) != list(map(comparable, orm_params)):
            return f"the parameters filled in are {params!r}, compiled per call {orm_params!r}"
        return None


def _run(using: str, sql: str, params: list[Any], *, prepare: bool) -> Any:
    """Run one statement; with ``prepare``, on PostgreSQL as a prepared statement (``fastpath.cursors``).

    A prepared statement the server session lost (a pooler between) stops
    preparing in this process; outside a transaction the statement, which
    changed nothing, runs again unnamed, inside one its error propagates.
    """
    connection = connections[using]
    with transaction.mark_for_rollback_on_error(using=using):
        if prepare and cursors.prepares(connection):
            try:
                with cursors.binding_cursor(connection, prepare=True) as cursor:
                    return _result(cursor, sql, params)
            except DatabaseError as exc:
                if not cursors.lost_prepared_statement(exc):
                    raise
                cursors.FAST_PATH.fall_back(f"the database session did not know a statement: {exc}")
                if connection.in_atomic_block:
                    raise
        with connection.cursor() as cursor:
            return _result(cursor, sql, params)


def _result(cursor: CursorWrapper, sql: str, params: list[Any]) -> Any:
    cursor.execute(sql, params)
    return cursor.fetchone() if cursor.description else cursor.rowcount


_M = TypeVar("_M", bound=Model)


class RowReader(Generic[_M]):
    """Turns a row of every concrete column of ``model``, as the database returns it, into an instance."""

    def __init__(self, model: type[_M]) -> None:
        self.model = model
        self._fields = model._meta.concrete_fields
        self._attnames = [field.attname for field in self._fields]
        self._pk_index = self._attnames.index(model._meta.pk.attname)
        #: Per database: each column with the converters its values go through (as a queryset's would).
        self._converters: dict[str, list[tuple[Any, list[Callable[..., Any]]]]] = {}
        #: The databases whose first row was read again by the ORM and compared (the self-check).
        self._checked: set[str] = set()

    def columns(self, using: str) -> str:
        """The RETURNING list that ``read`` expects: every concrete column, quoted."""
        quote = connections[using].ops.quote_name
        return ", ".join(quote(field.column) for field in self._fields)

    def read(self, using: str, row: tuple[Any, ...]) -> _M:
        """Return the instance ``row`` holds; on the slow path, the row as the ORM reads it again by its key."""
        if not FAST_PATH.fallen:
            try:
                instance = self._convert(using, row)
            except BREAKAGE as exc:
                FAST_PATH.fall_back(f"reading a row raised {exc!r}", exc)
            else:
                if using in self._checked:
                    return instance
                self._checked.add(using)
                if FAST_PATH.check(lambda: self._difference(using, row, instance)):
                    return instance
        return self._reread(using, row)

    def _convert(self, using: str, row: tuple[Any, ...]) -> _M:
        connection = connections[using]
        converters = self._converters.get(using)
        if converters is None:
            columns = [field.get_col(self.model._meta.db_table) for field in self._fields]
            converters = self._converters[using] = [
                (column, connection.ops.get_db_converters(column) + column.get_db_converters(connection))
                for column in columns
            ]
        values = []
        for value, (column, convert_all) in zip(row, converters, strict=True):
            for convert in convert_all:
                value = convert(value, column, connection)
            values.append(value)
        return self.model.from_db(using, self._attnames, values)

    def _reread(self, using: str, row: tuple[Any, ...]) -> _M:
        return self.model._base_manager.using(using).get(pk=row[self._pk_index])

    def _difference(self, using: str, row: tuple[Any, ...], instance: _M) -> str | None:
        """How ``instance`` differs from its row read again by the ORM; ``None``: alike."""
        again = self._reread(using, row)
        for attname in self._attnames:
            if comparable(getattr(instance, attname)) != comparable(getattr(again, attname)):
                return f"{attname}: {getattr(instance, attname)!r}, the ORM reads {getattr(again, attname)!r}"
        return None
