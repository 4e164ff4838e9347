"""The adapters on the web: the admin, the API, the probes, the metrics and the cluster view."""
