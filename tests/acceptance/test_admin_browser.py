"""A real browser (Debian's chromium, headless) through the admin, with a real beat and worker.

Saves screenshots of the schedule page (with its buttons), the execution
list, the cluster page and the overview under docs/ (the README and docs/getting-started.md show them).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth import get_user_model
from django.db import connections
from playwright.sync_api import Page, sync_playwright

from scheduler.models import Execution, Schedule
from tests.support.processes import ROOT, CeleryProcess, runserver, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

DOCS = ROOT / "docs"


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Page]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("chromium is not installed: `apt-get install chromium` (.ci/run installs it)", pytrace=False)
    # Playwright's sync API runs an event loop in this thread; the ORM calls
    # the test makes between browser steps are still plain synchronous ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox"] if os.geteuid() == 0 else []
        )
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()
            # ORM calls made while Playwright runs use a connection of their
            # own context; close it, or the test database cannot be dropped.
            connections.close_all()


@pytest.fixture
def web_url(process_env: dict[str, str], tmp_path: object) -> Iterator[str]:
    """Serve the admin with ``runserver`` in its own process (static files included)."""
    with runserver(process_env) as url:
        yield url


def test_admin_in_a_browser__create_preview_run_now_and_see_it_run(
    browser_page: Page, web_url: str, celery_processes: Callable[..., CeleryProcess]
) -> None:
    page = browser_page
    base = web_url
    get_user_model().objects.create_superuser("admin", "admin@example.invalid", "correct horse")
    celery_processes("worker", "w1").wait_for_log(r"ready\.")
    celery_processes("beat", "beat1")

    # Log in
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "correct horse")
    page.click("input[type=submit]")
    page.wait_for_selector("#site-name")

    # Create a schedule: a cron in Berlin, every day at 02:30
    page.goto(f"{base}/admin/scheduler/schedule/add/")
    page.fill("#id_name", "nightly report")
    page.fill("#id_task", "scheduler.echo")
    page.fill("#id_args", '["report"]')
    page.fill("#id_cron", "30 2 * * *")
    page.fill("#id_timezone", "Europe/Berlin")
    page.click("input[name=_continue]")

    # See its next fire times on its page
    page.wait_for_selector(".field-next_fire_times li")
    fire_times = page.locator(".field-next_fire_times li").all_inner_texts()
    assert len(fire_times) == 5 and all("02:30:00 CE" in text for text in fire_times), fire_times
    DOCS.mkdir(exist_ok=True)
    page.screenshot(path=str(DOCS / "admin-schedule.png"), full_page=True)

    # Run it now from the list
    schedule = Schedule.objects.get(name="nightly report")
    page.goto(f"{base}/admin/scheduler/schedule/")
    page.check(f"input[name=_selected_action][value='{schedule.pk}']")
    page.select_option("select[name=action]", "run_now")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist li")
    assert "1 execution started." in page.inner_text(".messagelist"), page.inner_text(".messagelist")

    # See the execution run
    assert wait_until(
        lambda: Execution.objects.filter(schedule=schedule, status=Execution.Status.SUCCEEDED).exists(), timeout=30
    ), list(Execution.objects.values_list("status", flat=True))
    page.goto(f"{base}/admin/scheduler/execution/")
    assert "succeeded" in page.inner_text("#result_list")

    # The buttons on the schedule's page: Run now, Pause with a reason, Resume
    page.goto(f"{base}/admin/scheduler/schedule/{schedule.pk}/change/")
    page.click("#action-run_now button")
    page.wait_for_selector(".messagelist li.info")
    assert "of nightly report started." in page.inner_text(".messagelist")
    assert wait_until(lambda: Execution.objects.filter(schedule=schedule, trigger="manual").count() == 2, timeout=10)
    page.fill("#action-pause input[name=reason]", "vendor outage")
    page.click("#action-pause button")
    page.wait_for_selector("#action-resume")
    assert "paused: vendor outage" in page.inner_text(".messagelist")
    schedule.refresh_from_db()
    assert schedule.paused_reason == "vendor outage"
    page.screenshot(path=str(DOCS / "admin-schedule-actions.png"), full_page=True)
    page.click("#action-resume button")
    page.wait_for_selector("#action-pause")
    schedule.refresh_from_db()
    assert schedule.paused_reason == ""

    # Retry on an execution's page: a new execution, shown with its trigger
    first = Execution.objects.filter(schedule=schedule, status=Execution.Status.SUCCEEDED).order_by("id").first()
    assert first is not None
    page.goto(f"{base}/admin/scheduler/execution/{first.pk}/change/")
    page.click("#action-retry button")
    page.wait_for_selector(".messagelist li.info")
    assert f"retries execution {first.pk}." in page.inner_text(".messagelist")
    assert wait_until(
        lambda: Execution.objects.filter(retry_of=first, status=Execution.Status.SUCCEEDED).exists(), timeout=30
    )

    # The execution list at 1400 px: times with seconds and zone, every column on screen
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(f"{base}/admin/scheduler/execution/")
    slots = page.locator("#result_list td.field-scheduled_for").all_inner_texts()
    assert slots and all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", text.strip()) for text in slots), slots
    assert {"manual (run now)", "retry"} <= set(page.locator("#result_list td.field-trigger").all_inner_texts())
    # (the list scrolls sideways inside its box when it is wider than the room beside the filters)
    widths = page.evaluate(
        "() => { const r = document.querySelector('#changelist .results'); return [r.scrollWidth, r.clientWidth]; }"
    )
    columns = page.evaluate(
        "() => [...document.querySelectorAll('#result_list thead th')].map(th => [th.className, th.offsetWidth])"
    )
    assert widths[0] <= widths[1], (widths, columns)
    page.screenshot(path=str(DOCS / "admin-executions.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})

    # The state icons are drawn, not empty glyph boxes
    page.goto(f"{base}/admin/scheduler/schedule/")
    icon = page.locator(".state i").first.bounding_box()
    assert icon is not None and icon["width"] > 0 and icon["height"] > 0

    # The cluster page shows the leading beat replica and the worker
    page.goto(f"{base}/admin/scheduler/lease/")
    leader = page.inner_text("#cluster-leader")
    assert leader != "nobody", page.content()
    assert "worker" in page.inner_text("#cluster-instances")
    page.screenshot(path=str(DOCS / "admin-cluster.png"), full_page=True)

    # The scheduler section opens on the overview: a beat leads, the schedule ran
    page.goto(f"{base}/admin/scheduler/")
    assert page.inner_text("#overview-leader") != "", page.content()
    assert "no beat leads" not in page.inner_text("#overview-leader")
    page.screenshot(path=str(DOCS / "admin-overview.png"), full_page=True)
