"""Settings for the django-celery-beat peer (bench.scale): the project's, plus its DatabaseScheduler.

Used only inside ``bench/.venv-peers``, where django-celery-beat is installed.
"""

from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "django_celery_beat"]  # noqa: F405
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# scheduler.E002 refuses any beat scheduler but the project's own; this one is the peer.
SILENCED_SYSTEM_CHECKS = ["scheduler.E002"]
