"""AuditActorMiddleware: the request's user acts for the audit events that model signals record."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from scheduler.ops import audit


class AuditActorMiddleware:
    """Make ``audit.current_actor()`` the request's user while the request is served.

    A model signal (``scheduler.ops.access_audit``) has no request; the admin's
    user and group pages change users through the ORM. The user is read when
    an event is recorded, so a login during the request counts.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        with audit.acting(request):
            return self.get_response(request)
