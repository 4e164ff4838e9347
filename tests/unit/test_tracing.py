"""Tracing's configuration from the OTEL_* environment, and its hooks while it is off (the default)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from scheduler import tracing


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": " Console "}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_exporters_from_env__standard_values(environ: dict[str, str], expected: list[str]) -> None:
    # Given the environment / When it is read / Then it names these exporters (none: tracing stays off)
    assert tracing.exporters_from_env(environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "unknown exporter 'jaeger'; use console, otlp, none"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
            "only http/protobuf is supported",
        ),
    ],
)
def test_exporters_from_env__bad_value__one_line_error(environ: dict[str, str], message: str) -> None:
    # Given an exporter or protocol this project does not ship
    # When the environment is read
    with pytest.raises(ImproperlyConfigured) as raised:
        tracing.exporters_from_env(environ)
    # Then the error is one line naming the variable and what to use
    assert message in str(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith("OTEL_")


def test_tracing__off_by_default__hooks_add_nothing() -> None:
    # Given the suite's environment, which sets no OTEL_TRACES_EXPORTER
    assert not tracing.enabled()

    @tracing.traced("scheduler.test")
    def double(value: int) -> int:
        return value * 2

    # When the hooks run / Then they pass calls through and add no message headers
    with tracing.span("scheduler.tick", instance_id="x") as span:
        assert span is None
    assert double(21) == 42
    assert tracing.message_headers({"id": 1, "celery_task_id": "t"}) == {}
