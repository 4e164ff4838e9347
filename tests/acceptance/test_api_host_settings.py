"""The API keeps its documented behaviour whatever the host's ``REST_FRAMEWORK`` says.

The host's settings are in place when the server process starts (DRF binds
most of them to its view classes at import), so the project is served by
``runserver`` in its own process with ``tests.support.host_rest_settings``: session
authentication only, a browsable renderer, form parsers, limit-offset pages
of one, open permissions, no throttle, versioning, another schema class and
another error handler.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import pytest
import requests

from scheduler.models import ApiToken
from tests.support.factories import make_schedule
from tests.support.processes import runserver

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def host_api(process_env: dict[str, str]) -> Iterator[str]:
    """The demo project served with the host's ``REST_FRAMEWORK``; its API's base URL."""
    env = {
        **process_env,
        "DJANGO_SETTINGS_MODULE": "tests.support.host_rest_settings",
        "SCHEDULER_API_THROTTLE_RATE": "5/minute",
    }
    with runserver(env) as url:
        yield url


def test_api__under_a_hosts_rest_framework_settings__answers_as_documented(host_api: str) -> None:
    # Given: a viewer and an operator token, and three schedules
    _, viewer = ApiToken.issue("eyes", role="viewer", all_tenants=True)
    _, operator = ApiToken.issue("hands", role="operator", all_tenants=True)
    for name in ("a", "b", "c"):
        make_schedule(name)
    browser = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    as_viewer = {**browser, "Authorization": f"Bearer {viewer}"}
    as_operator = {**browser, "Authorization": f"Bearer {operator}"}
    api = f"{host_api}/api/v1"

    # Then: no credentials is a JSON 401 asking for a bearer token (not the host's error handler, not open)
    anonymous = requests.get(f"{api}/schedules/", headers=browser, timeout=10)
    assert anonymous.status_code == 401, anonymous.text[:300]
    assert anonymous.headers["Content-Type"] == "application/json"
    assert anonymous.headers["WWW-Authenticate"].startswith("Bearer")
    assert set(anonymous.json()) == {"detail"}

    # And a token works, answered in JSON although the caller prefers HTML, in the documented pages of 50
    listed = requests.get(f"{api}/schedules/", headers=as_viewer, timeout=10)
    assert listed.status_code == 200, listed.text[:300]
    assert listed.headers["Content-Type"] == "application/json"
    body = listed.json()
    assert set(body) == {"count", "next", "previous", "results"}
    assert body["count"] == 3 and [row["name"] for row in body["results"]] == ["a", "b", "c"]
    # And times are ISO-8601, in and out, whatever the host's formats
    assert datetime.fromisoformat(body["results"][0]["next_run_at"]).tzinfo is not None
    paged = requests.get(f"{api}/schedules/?page=2&page_size=2", headers=as_viewer, timeout=10).json()
    assert [row["name"] for row in paged["results"]] == ["c"]
    # And the filters are the API's own
    assert requests.get(f"{api}/schedules/?name=b", headers=as_viewer, timeout=10).json()["count"] == 1
    # And executions are cursor-paginated
    executions = requests.get(f"{api}/executions/", headers=as_viewer, timeout=10).json()
    assert set(executions) == {"next", "previous", "results"}

    # And a viewer's write is a 403 in JSON; an operator's form-encoded body is refused (JSON only)
    refused = requests.post(f"{api}/schedules/", headers=as_viewer, json={"name": "x"}, timeout=10)
    assert refused.status_code == 403 and set(refused.json()) == {"detail"}
    form = requests.post(f"{api}/schedules/", headers=as_operator, data={"name": "x"}, timeout=10)
    assert form.status_code == 415, form.text[:300]

    # And bad input is the documented field error; good input creates
    bad = requests.post(
        f"{api}/schedules/",
        headers=as_operator,
        timeout=10,
        json={"name": "nightly", "task": "scheduler.echo", "cron": "not a cron"},
    )
    assert bad.status_code == 400 and "cron" in bad.json(), bad.text[:300]
    created = requests.post(
        f"{api}/schedules/",
        headers=as_operator,
        timeout=10,
        json={"name": "nightly", "task": "scheduler.echo", "cron": "0 2 * * *", "timezone": "Europe/Berlin"},
    )
    assert created.status_code == 201, created.text[:300]

    stats = requests.get(f"{api}/stats/?since=2026-01-01T00:00:00Z", headers=as_operator, timeout=10)
    assert stats.status_code == 200 and stats.json()["since"].startswith("2026-01-01T00:00:00"), stats.text[:300]

    # And the schema is the API's OpenAPI document, and its docs page answers
    schema = requests.get(f"{host_api}/api/schema/?format=json", timeout=10)
    assert schema.status_code == 200, schema.text[:300]
    assert "/api/v1/schedules/" in schema.json()["paths"]
    assert requests.get(f"{host_api}/api/docs/", timeout=10).status_code == 200

    # And the API's own throttle applies (SCHEDULER_API_THROTTLE_RATE, 5 a minute here)
    _, counted = ApiToken.issue("counted", role="viewer", all_tenants=True)
    headers = {**browser, "Authorization": f"Bearer {counted}"}
    statuses = [requests.get(f"{api}/cluster/", headers=headers, timeout=10).status_code for _ in range(6)]
    assert statuses == [200] * 5 + [429], statuses
