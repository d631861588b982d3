"""hotwire_api: the HTTP control plane of hotwire (``/steer/*`` routes, admission on the OpenAI routes,
auth, Prometheus metrics) plus a Python client and the ``hotwire`` CLI.

Importing this package is cheap and imports no vLLM code: :func:`hotwire_api.mount.register` runs in
every vLLM process and only does work in the API server.
"""
