"""Every admin list of the app, asked to filter by a NUL (``?field=%00``) or a number past 64 bits, or to act on rows no id names: never a 500.

PostgreSQL refuses a NUL in any text, and SQLite cannot bind a number past
64 bits (Django guards an integer column's lookups, not a foreign key's),
so such a lookup would fail when the page reads its rows. Each list answers
as Django's admin does for a lookup it cannot apply: back to the list, with
``?e=1`` (``scheduler.web.admin_lists``). An action's selected rows are the
page's form to post, and so anyone's to forge: a selection that is no id
goes back to the list, with a message, and changes nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.db import models
from django.test import Client
from django.urls import reverse

from scheduler.web.admin_lists import StorableLookups

pytestmark = pytest.mark.django_db(transaction=True)

APPS = ("scheduler", "django_celery_results")


def _lists() -> list[tuple[str, str, str]]:
    """(app, model, its first text field) of each admin list of ``APPS``."""
    found = []
    for model in admin.site._registry:
        text = [f.name for f in model._meta.fields if isinstance(f, models.CharField) and not f.choices]
        if model._meta.app_label in APPS and text:
            found.append((model._meta.app_label, model._meta.model_name, text[0]))
    return sorted(found)


def _foreign_keys() -> list[tuple[str, str, str]]:
    """(app, model, a foreign key) of each admin list of ``APPS`` whose model has one."""
    found = []
    for model in admin.site._registry:
        keys = [f.name for f in model._meta.fields if isinstance(f, models.ForeignKey)]
        if model._meta.app_label in APPS and keys:
            found.append((model._meta.app_label, model._meta.model_name, keys[0]))
    return sorted(found)


@pytest.mark.parametrize(("app", "model", "field"), _lists())
def test_a_nul_in_a_lookup__back_to_the_list_never_a_500(app: str, model: str, field: str) -> None:
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    url = reverse(f"admin:{app}_{model}_changelist")
    for query in (f"?{field}=%00", "?status__exact=%00", "?q=a%00b"):
        response: Any = client.get(url + query)
        assert response.status_code in (200, 302), (url + query, response.status_code)


@pytest.mark.parametrize(("app", "model", "field"), _foreign_keys())
def test_a_number_past_64_bits_in_a_lookup__back_to_the_list_never_a_500(app: str, model: str, field: str) -> None:
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    url = reverse(f"admin:{app}_{model}_changelist")
    # (past 4,300 digits Python itself refuses to read the number)
    for value in ("99999999999999999999", "-99999999999999999999", "9" * 5000):
        response: Any = client.get(f"{url}?{field}={value}")
        assert (response.status_code, response.get("Location")) == (302, f"{url}?e=1"), (field, value)


def _admin_lists() -> list[tuple[str, str]]:
    return sorted(
        (model._meta.app_label, model._meta.model_name)
        for model in admin.site._registry
        if model._meta.app_label in APPS
    )


@pytest.mark.parametrize(("app", "model"), _admin_lists())
def test_an_action_on_rows_no_id_names__back_to_the_list_never_a_500(app: str, model: str) -> None:
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    url = reverse(f"admin:{app}_{model}_changelist")
    for selected in ("abc", "1.5", "a\x00b", "99999999999999999999", "9" * 5000):
        response: Any = client.post(url, {"action": "delete_selected", "_selected_action": [selected]})
        # (a list with no such action shows itself again, as Django does: 200)
        assert response.status_code in (200, 302, 403) and response.get("Location", url) == url, (selected, response)


@pytest.mark.parametrize(("app", "model"), _admin_lists())
def test_a_nul_in_a_pages_id__no_such_row_never_a_500(app: str, model: str) -> None:
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    # (``_00`` is a NUL as the admin quotes an id in its links)
    for object_id, view in itertools.product(("%00", "a_00b"), ("change", "delete", "history")):
        response: Any = client.get(f"/admin/{app}/{model}/{object_id}/{view}/")
        assert response.status_code in (302, 403, 404), (object_id, view, response.status_code)


def test_a_nul_in_an_autocomplete_search__no_match_never_a_500() -> None:
    client = Client(raise_request_exception=False)
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    # The execution list's schedule filter searches the schedules
    query = {"app_label": "scheduler", "model_name": "execution", "field_name": "schedule", "term": "a\x00"}
    response: Any = client.get("/admin/autocomplete/", query)
    assert (response.status_code, response.json()["results"]) == (200, [])


def test_every_admin_of_the_app_refuses_such_lookups() -> None:
    ours = {model: model_admin for model, model_admin in admin.site._registry.items() if model._meta.app_label in APPS}
    assert ours and all(isinstance(model_admin, StorableLookups) for model_admin in ours.values()), [
        type(model_admin).__name__ for model_admin in ours.values() if not isinstance(model_admin, StorableLookups)
    ]
