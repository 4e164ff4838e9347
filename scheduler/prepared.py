"""ORM statements compiled once per process and run again with new values: the worker's per-task writes.

Django compiles a queryset to SQL on every call, and for the guard's claim
and finish that costs several times what the database does for them
(``python -m bench.worker_overhead --profile``). A ``Prepared`` statement is
built from the ORM as usual, once per database and variant, with ``Param``
expressions standing where the values of a call go; a call puts its values,
adapted by the column's field as the ORM would, in their place and runs the
same SQL. The SQL is the ORM's own, so both databases get what they always
got.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from django.db import connections, transaction
from django.db.models import Expression, Field, Model
from django.db.models.sql.compiler import SQLCompiler


class Param(Expression):
    """Where a call's value ``name`` goes: compiles to one placeholder, adapted per call by ``output_field``."""

    def __init__(self, name: str, output_field: Field) -> None:
        super().__init__(output_field=output_field)
        self.name = name

    def as_sql(self, compiler: SQLCompiler, connection: Any) -> tuple[str, list[Any]]:
        return "%s", [self]


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
        key = (using, *variant)
        compiled = self._compiled.get(key)
        if compiled is None:  # two threads may both compile it: the same result
            compiled = self._compiled[key] = self._build(using, *variant)
        sql, template = compiled
        connection = connections[using]
        params = [
            param.output_field.get_db_prep_save(values[param.name], connection) if isinstance(param, Param) else param
            for param in template
        ]
        with transaction.mark_for_rollback_on_error(using=using), connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone() if cursor.description else cursor.rowcount


_M = TypeVar("_M", bound=Model)


class RowReader(Generic[_M]):
    """Turns a row of every concrete column of ``model``, as the database returns it, into an instance."""

    def __init__(self, model: type[_M]) -> None:
        self.model = model
        self._fields = model._meta.concrete_fields
        self._attnames = [field.attname for field in self._fields]
        #: Per database: each column with the converters its values go through (as a queryset's would).
        self._converters: dict[str, list[tuple[Any, list[Callable[..., Any]]]]] = {}

    def columns(self, using: str) -> str:
        """The RETURNING list that ``read`` expects: every concrete column, quoted."""
        quote = connections[using].ops.quote_name
        return ", ".join(quote(field.column) for field in self._fields)

    def read(self, using: str, row: tuple[Any, ...]) -> _M:
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
