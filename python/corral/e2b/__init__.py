"""An E2B-compatible front: the stock ``e2b`` SDK, pointed at it with environment variables,
drives corral sandboxes (docs/e2b.md).

connect.py     the Connect protocol (JSON codec): envelopes, error codes, server streams
pbjson.py      proto3 JSON shapes the SDK decodes: entries, timestamps, bytes, selectors
auth.py        the front's API key and the per-sandbox envd access tokens
errors.py      corral errors -> what the e2b SDK expects (HTTP statuses, Connect codes)
users.py       the envd user of a request (``user`` or ``root``) and its home
templates.py   E2B templates -> corral create specs; the ``base`` template's snapshot
state.py       what the front remembers per sandbox: the processes it started, their tags
sandboxes.py   the control plane: /sandboxes, /v2/sandboxes
process.py     envd's process service
filesystem.py  envd's filesystem service
files.py       envd's HTTP API: /files upload and download, /health
app.py         the aiohttp application: routes, auth, error middleware
serve.py       run it (``corral e2b serve``); config.py its defaults
"""
