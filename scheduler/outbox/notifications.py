"""Delivering the notifications owed (``owners.notifications``): e-mail, signed webhooks, Slack, check-ins; never inside a transaction.

The beat leader's housekeeping calls ``deliver_due``. A webhook's body is
the notification's JSON; its ``X-Scheduler-Signature`` is
``sha256=<hex HMAC-SHA256 of "<timestamp>.<body>" with the target's secret>``
and ``X-Scheduler-Timestamp`` the timestamp, so a receiver can check both
and refuse an old replay; ``X-Scheduler-Delivery`` names the notification,
the same on every attempt, so a receiver that got an attempt whose answer
was lost can tell the next one apart. A check-in is a POST to the
monitor's URL (``check_in_url``) with the one-line text as its body. An answer other than 2xx, a timeout
(``SCHEDULER_NOTIFY_TIMEOUT_SECONDS`` for the whole exchange), a redirect (never followed) or a
refused connection is a failed attempt, tried again after its backoff.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.mail import get_connection, send_mail

from scheduler import dbclock
from scheduler.conf import settings
from scheduler.exceptions import first_line
from scheduler.models import Notification, NotificationTarget
from scheduler.owners import notifications

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Scheduler-Signature"
TIMESTAMP_HEADER = "X-Scheduler-Timestamp"
DELIVERY_HEADER = "X-Scheduler-Delivery"
#: Notifications one pass delivers; the rest wait for the next pass.
PASS_LIMIT = 50


class DeliveryFailed(Exception):
    """One attempt did not deliver: the reason, as the admin shows it."""


@dataclass(frozen=True)
class Delivered:
    delivered: int
    failed: int


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def deliver_due(*, limit: int = PASS_LIMIT) -> Delivered:
    """Try each due notification once; return how many were delivered and how many failed this time."""
    delivered = failed = 0
    for row in notifications.take_due(limit=limit, now=dbclock.now()):
        try:
            _send(row)
        except DeliveryFailed as exc:
            failed += 1
            notifications.failed(row, str(exc), now=dbclock.now())
            logger.warning(
                "notification %s to %s not delivered (attempt %s): %s",
                row.pk,
                row.target,
                row.attempts + 1,
                exc,
                extra={"action": "notification_failed", "notification": row.pk},
            )
        else:
            delivered += 1
            notifications.delivered(row)
    return Delivered(delivered, failed)


def text_of(row: Notification) -> str:
    """The one-line message of a notification (e-mail subject, Slack text)."""
    return f"[scheduler] {row.payload.get('summary') or row.get_event_display()}"


def _send(row: Notification) -> None:
    target = row.target
    try:
        if target.kind == NotificationTarget.Kind.EMAIL:
            send_mail(
                text_of(row)[:200], json.dumps(row.payload, indent=2), None, [target.address], connection=_mailer()
            )
        elif target.kind == NotificationTarget.Kind.SLACK:
            _post(target.address, json.dumps({"text": text_of(row)}).encode(), {})
        elif target.is_check_in:
            _post(check_in_url(target, row), text_of(row).encode(), {"Content-Type": "text/plain"})
        else:
            body = json.dumps(row.payload, sort_keys=True).encode()
            timestamp = str(int(time.time()))
            headers = {
                TIMESTAMP_HEADER: timestamp,
                SIGNATURE_HEADER: sign(target.secret, timestamp, body),
                DELIVERY_HEADER: str(row.pk),
            }
            _post(target.address, body, headers)
    except DeliveryFailed:
        raise
    except Exception as exc:  # a mail server, DNS, TLS...: whatever failed, this attempt did
        raise DeliveryFailed(first_line(exc)) from exc


#: What each event tells a check-in monitor: Healthchecks.io's path suffix, Sentry Crons' status.
_CHECK_IN = {
    Notification.Event.RUN_STARTED: ("/start", "in_progress"),
    Notification.Event.RUN_SUCCEEDED: ("", "ok"),
    Notification.Event.EXECUTION_FAILED: ("/fail", "error"),
}


def check_in_url(target: NotificationTarget, row: Notification) -> str:
    """The URL a check-in of ``row``'s run goes to.

    A run id names the attempt, the same at its start and its end, so a
    monitor pairs them when runs overlap: Healthchecks.io's ``rid``, Sentry's
    ``check_in_id``.
    """
    suffix, status = _CHECK_IN[row.event]  # type: ignore[index]  # an event check-ins get (targets_for)
    run_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"execution:{row.payload['execution']}:{row.payload['attempt']}"))
    url = target.address
    if target.kind == NotificationTarget.Kind.HEALTHCHECKS:
        url, query = url.rstrip("/") + suffix, {"rid": run_id}
    else:
        query = {"status": status, "check_in_id": run_id}
    return f"{url}{'&' if '?' in url else '?'}{urllib.parse.urlencode(query)}"


def _mailer() -> Any:
    """The host's mail connection, waiting at most the delivery's timeout for each answer unless ``EMAIL_TIMEOUT`` says.

    Django's SMTP connection waits for ever by default: a server that took
    the connection and never answered would hold the delivery pass.
    """
    if getattr(django_settings, "EMAIL_TIMEOUT", None) is not None:
        return get_connection()
    try:
        return get_connection(timeout=settings.NOTIFY_TIMEOUT_SECONDS)
    except TypeError:  # a host's backend that takes no timeout
        return get_connection()


def _post(url: str, body: bytes, headers: dict[str, str]) -> None:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", **headers}
    )
    seconds = settings.NOTIFY_TIMEOUT_SECONDS
    deadline = _Deadline(seconds)
    try:
        with deadline, deadline.opener().open(request, timeout=seconds) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        moved = exc.headers.get("Location") if 300 <= exc.code < 400 else None
        raise DeliveryFailed(
            f"HTTP {exc.code}: redirects are not followed; moved to {moved}" if moved else f"HTTP {exc.code}"
        ) from None
    except (OSError, http.client.HTTPException) as exc:  # refused, timed out, not HTTP, or cut at the deadline
        raise DeliveryFailed(f"timed out after {seconds:g}s" if deadline.cut else first_line(exc)) from None
    if not 200 <= status < 300:
        raise DeliveryFailed(f"HTTP {status}")


class _Deadline:
    """Cuts an HTTP exchange off when ``seconds`` have passed since it began.

    A socket's timeout bounds each read, not the exchange: a receiver that
    sends its answer a byte at a time, each within the timeout, would hold
    the delivery pass (and the watch that shares its thread) for as long as
    it likes. At the deadline the connection's socket is shut down, which
    ends the read it blocks in.
    """

    def __init__(self, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._cut)
        self._connections: list[http.client.HTTPConnection] = []
        self.cut = False

    def __enter__(self) -> None:
        self._timer.start()

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()

    def opener(self) -> urllib.request.OpenerDirector:
        """urllib's usual opener (proxies from the environment included), its connections cut at the deadline.

        It follows no redirect: urllib would follow a POST's 301-303 as a GET
        without the body, and its 200 would count as delivered.
        """
        handlers: list[_CutAtDeadline] = [_CutHTTPHandler(), _CutHTTPSHandler()]
        for handler in handlers:
            handler.deadline = self
        return urllib.request.build_opener(*handlers, _NoRedirects())

    def connection(self, http_class: Callable[..., http.client.HTTPConnection]) -> Callable[..., Any]:
        def connect(*args: Any, **kwargs: Any) -> http.client.HTTPConnection:
            made = http_class(*args, **kwargs)
            self._connections.append(made)
            return made

        return connect

    def _cut(self) -> None:
        self.cut = True
        for made in self._connections:
            if made.sock is not None:
                with contextlib.suppress(OSError):
                    made.sock.shutdown(socket.SHUT_RDWR)


class _CutAtDeadline(urllib.request.AbstractHTTPHandler):
    deadline: _Deadline

    def do_open(self, http_class: Any, req: urllib.request.Request, **http_conn_args: Any) -> Any:
        return super().do_open(self.deadline.connection(http_class), req, **http_conn_args)


class _CutHTTPHandler(_CutAtDeadline, urllib.request.HTTPHandler):
    pass


class _CutHTTPSHandler(_CutAtDeadline, urllib.request.HTTPSHandler):
    pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError
