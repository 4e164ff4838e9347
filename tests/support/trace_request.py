"""Run as ``python -m tests.support.trace_request TRACEPARENT``: one web request whose view calls ``scheduler.submit()``.

A process of its own, so tracing is configured from its environment
(``OTEL_TRACES_EXPORTER``) as a web process's is, and the Django
instrumentation traces the request. Prints the created execution's id as
``execution <id>``; the spans follow on standard output when it exits.
"""

from __future__ import annotations

import os
import sys

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup()

from django.http import HttpRequest, JsonResponse  # noqa: E402 -- after django.setup()
from django.test import Client, override_settings  # noqa: E402
from django.urls import path  # noqa: E402

import scheduler  # noqa: E402


def submit_view(request: HttpRequest) -> JsonResponse:
    execution = scheduler.submit("scheduler.echo", ["traced"], tenant="team-web")
    return JsonResponse({"execution_id": execution.pk})


urlpatterns = [path("submit", submit_view)]


def main(traceparent: str) -> None:
    with override_settings(ROOT_URLCONF=__name__):
        response = Client(HTTP_HOST="localhost").post("/submit", HTTP_TRACEPARENT=traceparent)
    # One write: print() writes the line and its newline apart, and the span exporter's thread can land between them.
    sys.stdout.write(f"execution {response.json()['execution_id']}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
