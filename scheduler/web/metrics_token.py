"""The bearer token of the endpoints for machines, ``/metrics`` and ``/healthz/schedules`` (``SCHEDULER_METRICS_TOKEN``).

Both name the schedules, tasks, queues and hosts of every tenant, so they
are not tenant-scoped views but a platform's: with a token configured, a
request must carry ``Authorization: Bearer <token>`` or gets a bare 401.
Without one they stay open, as Prometheus scrapers expect by default.
The probes load balancers call (``/healthz``, ``/readyz``, ``/leaderz``)
are never gated: they cannot send a header.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from scheduler.conf import settings

View = Callable[[HttpRequest], HttpResponse]


def expected() -> str:
    """Return the configured token, ``""`` when none is (the endpoints are open)."""
    # Prometheus trims the credentials file it reads, so surrounding whitespace is never part of a token.
    return (settings.METRICS_TOKEN or "").strip()


def is_allowed(request: HttpRequest) -> bool:
    """Whether ``request`` may read the endpoints: no token is configured, or it sends that token."""
    token = expected()
    if not token:
        return True
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    # The scheme is case-insensitive (RFC 7235); the comparison takes the same time whatever matches.
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode())


def token_required(view: View) -> View:
    """Answer 401 with a ``Bearer`` challenge, and nothing else, unless ``is_allowed``."""

    @functools.wraps(view)
    def wrapped(request: HttpRequest) -> HttpResponse:
        if not is_allowed(request):
            response = JsonResponse({"status": "unauthorized"}, status=401)
            response["WWW-Authenticate"] = "Bearer"
            return response
        return view(request)

    return wrapped
