"""``AnyOf``: a column is one of many values, as one array parameter on PostgreSQL instead of one parameter each."""

from __future__ import annotations

from typing import Any

from django.db.models import Lookup
from django.db.models.lookups import In


class AnyOf(Lookup):
    """``lhs`` is one of ``values``, for a filter: ``Schedule.objects.filter(AnyOf(F("pk"), ids))``.

    ``pk__in`` with a batch of a few thousand ids prepares, quotes and sends
    each id on its own: a leader's burst spent a tenth of its time there. On
    PostgreSQL this sends the whole list as one array (``= ANY(%s)``);
    elsewhere it is ``IN``.
    """

    prepare_rhs = False

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, Any]:
        return compiler.compile(In(self.lhs, self.rhs))

    def as_postgresql(self, compiler: Any, connection: Any) -> tuple[str, Any]:
        lhs, params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s)", (*params, list(self.rhs))
