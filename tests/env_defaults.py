"""Environment defaults that must exist before pytest-django imports settings."""
from __future__ import annotations

import os

# Loaded as a plugin (`-p tests.env_defaults` in pytest.ini) because
# pytest-django 4.14 imports project.settings in pytest_load_initial_conftests,
# before any conftest.py is imported, so a conftest.py is too late. Settings
# refuse to load without SECRET_KEY unless DEBUG is on; tests need neither a
# real key nor production security. An explicit environment still wins.
os.environ.setdefault("DJANGO_DEBUG", "1")
