"""Admin lists refuse a lookup holding a NUL, as Django's admin refuses one it cannot apply.

PostgreSQL stores a NUL in no text, so ``?task=%00`` would fail when the
page reads its rows: a 500. Every admin of the app (and of the results it
shows) mixes in ``TextLookups``; ``tests/integration/test_admin_lookups.py``
checks each registered one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ERROR_FLAG
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

if TYPE_CHECKING:
    _AdminBase = admin.ModelAdmin[Any]
else:
    _AdminBase = object  # a mixin: the admin class supplies ModelAdmin


class TextLookups(_AdminBase):
    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if any("\x00" in key or "\x00" in value for key, values in request.GET.lists() for value in values):
            # What Django answers a lookup it cannot apply: the list, flagged "invalid".
            return HttpResponseRedirect(f"{request.path}?{ERROR_FLAG}=1")
        return super().changelist_view(request, extra_context)
