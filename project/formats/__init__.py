"""Date and time formats of the admin (``FORMAT_MODULE_PATH``): seconds and the zone on every time."""
