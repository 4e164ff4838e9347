"""Environment defaults that must exist before pytest-django imports settings."""

from __future__ import annotations

import os

import pytest

# Loaded as a plugin (`-p tests.support.env_defaults` in pytest.ini) because
# pytest-django 4.14 imports project.settings in pytest_load_initial_conftests,
# before any conftest.py is imported, so a conftest.py is too late. Settings
# refuse to load without SECRET_KEY unless DEBUG is on; tests need neither a
# real key nor production security. An explicit environment still wins.
os.environ.setdefault("DJANGO_DEBUG", "1")
# django-celery-beat's tables in the test database (requirements-dev.txt),
# for tests/integration/test_import_celery_beat.py; see project/settings.py.
_CELERY_BEAT_TABLES_SET_HERE = "TEST_CELERY_BEAT_TABLES" not in os.environ
os.environ.setdefault("TEST_CELERY_BEAT_TABLES", "1")


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Keep django-celery-beat to this process once its settings are loaded.

    The beat, worker and runserver processes the tests start inherit the
    environment; with the app installed there, the admin screenshots in
    docs/ would show django-celery-beat's models.
    """
    if _CELERY_BEAT_TABLES_SET_HERE:
        os.environ.pop("TEST_CELERY_BEAT_TABLES", None)
