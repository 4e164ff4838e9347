"""Every model change ships with its migration: ``makemigrations --check --dry-run`` finds nothing to write."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_models__have_every_migration() -> None:
    # Given the models and the migrations on disk
    out = io.StringIO()
    # When makemigrations looks for changes without writing any
    try:
        call_command("makemigrations", check=True, dry_run=True, verbosity=1, stdout=out, stderr=out)
    except SystemExit as exc:
        # Then it has none (--check exits non-zero when it would write one)
        pytest.fail(
            f"a model change has no migration (exit {exc.code}); run `manage.py makemigrations`:\n{out.getvalue()}"
        )
    assert "No changes detected" in out.getvalue()
