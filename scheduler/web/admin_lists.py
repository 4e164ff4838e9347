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
  each registered one). So is an action's selection that is no id
  (``_selected_action=abc``: the form is the page's, anyone's to forge).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ERROR_FLAG
from django.core.exceptions import PermissionDenied
from django.db import models
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
    """Refuse a lookup no database can compare with as Django refuses one it cannot apply, and rows no id names."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if any("\x00" in key or _unstorable(value) for key, values in request.GET.lists() for value in values):
            # What Django answers a lookup it cannot apply: the list, flagged "invalid".
            return HttpResponseRedirect(f"{request.path}?{ERROR_FLAG}=1")
        selected = request.POST.getlist(ACTION_CHECKBOX_NAME) if request.method == "POST" else []
        if not all(map(self._names_a_row, selected)):
            # Django reads the selection as ids only when the action's query runs: a 500.
            messages.warning(request, "No row has that id. No items have been changed.")
            return HttpResponseRedirect(request.get_full_path())
        return super().changelist_view(request, extra_context)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        # A NUL in the page's id (``/lease/%00/change/``, or ``_00`` as the admin quotes one): no row, not a 500.
        if "\x00" in unquote(object_id):
            return None
        return super().get_object(request, object_id, from_field)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> Any:
        # The lists refuse such a search above; another page's autocomplete searches here too.
        if "\x00" in search_term:
            return queryset.none(), False
        return super().get_search_results(request, queryset, search_term)

    def _names_a_row(self, value: str) -> bool:
        if isinstance(self.model._meta.pk, models.IntegerField):
            return limits.is_key_text(value)
        return "\x00" not in value
