"""The HTTP API under ``/api/v1/``: Django REST framework views over the same domain functions as the admin and CLI."""
