#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        # Load the settings first: some commands (makemigrations) swallow a
        # settings error and then fail with an unrelated traceback.
        settings.INSTALLED_APPS
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A configuration mistake deserves one line saying what to set, not a traceback.
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
