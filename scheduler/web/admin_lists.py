"""What every admin list of the app does beyond Django's: scoped rows, actions that need permission, text lookups.

Each is a mixin of a ``ModelAdmin``:

- ``TenantScoped``: a staff user sees and changes only the rows of its scope.
- ``ActionsNeedPermission``: an action the user may not run answers 403.
- ``StorableLookups``: a lookup holding a NUL (``?task=%00``), which
  PostgreSQL stores in no text, or a number past 64 bits
  (``?schedule=99999999999999999999``), which SQLite cannot bind (Django
  guards an integer column's lookups, not a foreign key's), would fail
  when the page reads its rows (a 500); it is refused as Django refuses a
  lookup it cannot apply. Every admin of the app, and of the results it
  shows, mixes it in (``tests/integration/test_admin_lists.py`` checks
  each registered one).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ERROR_FLAG
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from scheduler import limits
from scheduler.tenancy import scope_of_user

if TYPE_CHECKING:
    _AdminBase = admin.ModelAdmin[Any]
else:
    _AdminBase = object  # a mixin: the admin class supplies ModelAdmin


class TenantScoped(_AdminBase):
    """A staff user sees and changes only the rows of its scope: its tenant, every tenant, or none (``tenancy``)."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return scope_of_user(request.user).filter(super().get_queryset(request))


class ActionsNeedPermission(_AdminBase):
    """Answer 403 to an action the user may not run, instead of Django's silent "no action"."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        action = request.POST.get("action") if request.method == "POST" else None
        if action and action not in self.get_actions(request):
            raise PermissionDenied(f"You may not run {action!r}.")
        return super().changelist_view(request, extra_context)


#: A whole number, as a lookup's value may name one.
_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")


def _unstorable(value: str) -> bool:
    """Whether no database can compare with ``value``: it holds a NUL, or is a number past 64 bits."""
    if "\x00" in value:
        return True
    if _WHOLE_NUMBER.fullmatch(value) is None:
        return False
    # Counted before read: past 4,300 digits int() itself raises.
    digits = value.lstrip("+-").lstrip("0")
    return len(digits) > len(str(limits.KEY_MAX)) or int(digits or "0") > limits.KEY_MAX


class StorableLookups(_AdminBase):
    """Refuse a lookup no database can compare with as Django refuses one it cannot apply."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if any("\x00" in key or _unstorable(value) for key, values in request.GET.lists() for value in values):
            # What Django answers a lookup it cannot apply: the list, flagged "invalid".
            return HttpResponseRedirect(f"{request.path}?{ERROR_FLAG}=1")
        return super().changelist_view(request, extra_context)
