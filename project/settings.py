"""Django settings, read from the environment with safe defaults.

See the configuration table in docs/configuration.md. Scheduler-specific settings
(``SCHEDULER_*``) have their defaults in ``scheduler/conf.py``; set them here
only to override.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable ("1", "true", "yes", "on" are true)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = env_bool("DJANGO_DEBUG", False)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured(
            "SECRET_KEY is not set. Set the SECRET_KEY environment variable (or DJANGO_DEBUG=1 for local development)."
        )
    SECRET_KEY = "insecure-development-key-do-not-use-in-production"

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]" if DEBUG else "")
if not ALLOWED_HOSTS and not DEBUG:
    raise ImproperlyConfigured(
        "ALLOWED_HOSTS is not set. Set the ALLOWED_HOSTS environment variable to the comma-separated "
        "host names the site is served under (or DJANGO_DEBUG=1 for local development)."
    )

# --- HTTPS (production) -------------------------------------------------------
# Off only when debugging. Behind a TLS-terminating proxy, it must set
# X-Forwarded-Proto. The probes stay plain HTTP: a redirect would look like
# success to a Kubernetes probe.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^leaderz$", r"^metrics$"]
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
SECURE_HSTS_SECONDS = int(os.environ.get("SECURE_HSTS_SECONDS", "0" if DEBUG else "31536000"))
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    # Before the admin, so its admin/base_site.html (the no-leader warning on
    # every admin page) overrides the admin's own.
    "scheduler",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    # The HTTP API (/api/v1/), its schema and its docs (served from local files).
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
]
# Tests only (tests/support/env_defaults.py turns it on): django-celery-beat's real
# tables for the test of `manage.py import_celery_beat`, which reads them with
# SQL and never needs the package. Ignored unless debugging.
if DEBUG and env_bool("TEST_CELERY_BEAT_TABLES"):
    INSTALLED_APPS.append("django_celery_beat")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # The request's user acts for the audit events of user and group changes.
    "scheduler.web.middleware.AuditActorMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

if not DEBUG:
    # Serves the collected static files (the admin's) from gunicorn; when
    # debugging, runserver serves them from the apps.
    MIDDLEWARE.insert(1, "whitenoise.middleware.WhiteNoiseMiddleware")

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The demo's own admin/base_site.html: the scheduler's no-leader warning on every admin page.
        "DIRS": [BASE_DIR / "project" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

# --- Database ---------------------------------------------------------------
# PostgreSQL in production (DATABASE_URL=postgres://...); an embedded SQLite
# file under var/ otherwise. SQLite runs in WAL mode with a busy timeout and
# IMMEDIATE transactions so the web, worker and beat processes can share it
# without "database is locked" errors on lock upgrades.
DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    _busy_timeout = os.environ.get("SQLITE_BUSY_TIMEOUT_SECONDS") or "20"
    try:
        SQLITE_BUSY_TIMEOUT_SECONDS = float(_busy_timeout)
    except ValueError:
        SQLITE_BUSY_TIMEOUT_SECONDS = 0.0
    if not SQLITE_BUSY_TIMEOUT_SECONDS > 0:
        raise ImproperlyConfigured(f"SQLITE_BUSY_TIMEOUT_SECONDS={_busy_timeout!r} is not a positive number of seconds")
    DATABASES["default"]["OPTIONS"] = {
        "timeout": SQLITE_BUSY_TIMEOUT_SECONDS,  # seconds a statement waits for another writer to finish
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file, not Django's in-memory default: acceptance tests start real
    # celery processes that must see the same test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
# Times with seconds and zone everywhere in the admin: project/formats/en/formats.py.
FORMAT_MODULE_PATH = "project.formats"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", BASE_DIR / "staticfiles"))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}

# --- HTTP API ---------------------------------------------------------------
# Bearer tokens (manage.py api_tokens) or a staff user's session (with CSRF);
# the throttle's rate is SCHEDULER_API_THROTTLE_RATE.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "scheduler.web.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["scheduler.web.api.permissions.HasRole"],
    "DEFAULT_THROTTLE_CLASSES": ["scheduler.web.api.throttling.PerCallerThrottle"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "scheduler.web.api.schema.ApiSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Scheduler API",
    "DESCRIPTION": "Schedules, executions, cluster, reconcile, stats and the audit trail.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # The docs page loads its JavaScript and CSS from this server, not a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# --- Celery -----------------------------------------------------------------
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Django's tasks framework (the django-tasks backport on 5.2): @task functions run as executions.
TASKS = {"default": {"BACKEND": "scheduler.tasks_backend.SchedulerBackend"}}
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
# JSON only: pickle lets anyone who can write to the broker run code.
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_ENABLE_UTC = True
CELERY_BEAT_SCHEDULER = "scheduler.beat:LeaderScheduler"
# On a lost broker connection, let the bodies running go on. Their outcome is
# written to the database, not the broker; only their late ack is lost, and a
# message the broker kept and delivers again is refused by the claim. Stopping
# them would turn a broker restart into failed executions: the restarted broker
# has lost their messages, so nothing would run them again.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
# Celery's Django fixup closes the database connection before and after every
# task unless this is set; it then closes it every this many tasks instead, and
# the worker's own hooks close it by CONN_MAX_AGE (SCHEDULER_WORKER_CONN_MAX_AGE,
# see scheduler/worker/task.py), so a worker keeps one connection across tasks.
CELERY_DB_REUSE_MAX = 1000

# SCHEDULER_* settings (defaults in scheduler/conf.py) may also come from the
# environment, e.g. SCHEDULER_LEASE_TTL_SECONDS=10.
from scheduler.conf import DEPRECATED_NAMES as _DEPRECATED  # noqa: E402 -- needs BASE_DIR on sys.path only
from scheduler.conf import Defaults as _SchedulerDefaults  # noqa: E402 -- needs BASE_DIR on sys.path only

_deprecated_defaults = {old: getattr(_SchedulerDefaults, new) for old, new in _DEPRECATED.items()}
for _name, _default in [*vars(_SchedulerDefaults).items(), *_deprecated_defaults.items()]:
    _raw = os.environ.get(f"SCHEDULER_{_name}")
    if _name.isupper() and _raw:
        try:
            # bool("0") is True: booleans read like the other switches here.
            globals()[f"SCHEDULER_{_name}"] = (
                env_bool(f"SCHEDULER_{_name}") if isinstance(_default, bool) else type(_default)(_raw)
            )
        except ValueError:
            raise ImproperlyConfigured(f"SCHEDULER_{_name}={_raw!r} is not a valid {type(_default).__name__}") from None

# SCHEDULER_LOG_FORMAT=json writes the scheduler's logs as JSON lines; every
# record carries the instance id, lease token, execution id and schedule in
# scope (scheduler/logs.py).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "context": {"()": "scheduler.logs.ContextFilter"},
    },
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "scheduler.logs.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if os.environ.get("SCHEDULER_LOG_FORMAT", "").lower() == "json" else "plain",
            "filters": ["context"],
        },
    },
    "loggers": {
        "scheduler": {
            "handlers": ["console"],
            "level": os.environ.get("SCHEDULER_LOG_LEVEL", "INFO"),
            "propagate": False,
        },
    },
}
