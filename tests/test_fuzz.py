"""The API under schemathesis: generated requests, valid and not, against a real daemon over TCP
with a token, every check (all on in fuzz/schemathesis.toml, the same as `--checks all`, which
on the command line would also override the few per-operation exceptions written there with
their reasons) and a stateful phase that follows the spec's links
(create -> exec, files, snapshot, fork ...). No failure is allowed: no 5xx, no status or body
the spec does not declare, no valid request refused, no invalid one accepted, 405s with Allow.

Brief by default (a couple of minutes on two cores). The test reads knobs to run longer:
CORRAL_FUZZ_EXAMPLES (cases per operation and phase, default 25), CORRAL_FUZZ_SEED (default
fixed, so a default run is reproducible; ``random`` for a fresh one).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from corral.daemon.app import ROUTES
from corral.daemon.openapi import SPEC_PATH

from apiclient import client
from conftest import CGROUP_NAME, free_port, private_daemon

pytest.importorskip("schemathesis")
HERE = Path(__file__).resolve().parent
ST = Path(sys.executable).with_name("st")
# What generated requests must reach, accepted by the daemon: one operation of each group.
MUST_REACH = {
    "exec": ("exec_cmd",),
    "files": ("file_write", "file_read", "file_list", "file_stat", "file_mkdir", "tar_upload"),
    "snapshots": ("snapshot_sandbox", "restore_sandbox"),
    "fork": ("fork_sandbox",),
}


@pytest.fixture(scope="module")
def tcp_daemon():
    """A daemon of its own, on TCP with a token (what a remote client has), small capacity
    (generated batch creates and forks of 10,000 get capacity_exceeded, not a full host)."""
    port, token = free_port(), secrets.token_hex(16)
    with private_daemon("corral-fuzz-", f"{CGROUP_NAME}-fuzz", CORRAL_MAX_SANDBOXES="24",
                        CORRAL_POOL="off", CORRAL_TCP=f"127.0.0.1:{port}",
                        CORRAL_TOKEN=token,
                        # generated image references must not reach the network (DNS)
                        CORRAL_REGISTRIES="registry.invalid") as d:
        d.port, d.token = port, token  # type: ignore[attr-defined]
        yield d


_TEMPLATES = [(r.method, re.compile("^" + re.sub(r"\{[^}]+\}", "[^/]+", r.path) + "$"),
               r.handler.__name__) for r in ROUTES]


def _operation(method: str, path: str) -> str | None:
    # Literal paths first (/v1/sandboxes/batch is not /v1/sandboxes/{id}).
    for m, rx, name in sorted(_TEMPLATES, key=lambda t: t[1].pattern.count("[^/]+")):
        if m == method and rx.match(path):
            return name
    return None


def _accepted(har: Path) -> Counter[str]:
    """2xx answers per operation, from schemathesis' HAR report."""
    ok: Counter[str] = Counter()
    for entry in json.loads(har.read_text())["log"]["entries"]:
        status = entry["response"]["status"]
        name = _operation(entry["request"]["method"], urlsplit(entry["request"]["url"]).path)
        if name and 200 <= status < 300:
            ok[name] += 1
    return ok


def test_the_config_enables_every_check():
    """What `--checks all` selects (max_response_time needs a limit and is not a check of
    correctness)."""
    import schemathesis.specs.openapi.checks  # noqa: F401 - registers the OpenAPI checks
    from schemathesis.checks import CHECKS
    from schemathesis.config import SchemathesisConfig

    cfg = SchemathesisConfig.from_path(str(HERE / "fuzz" / "schemathesis.toml"))
    checks = cfg.projects.default.checks_config_for()
    off = [c.__name__ for c in CHECKS.get_all() if not checks.get_by_name(name=c.__name__).enabled]
    assert off == [] and len(CHECKS.get_all()) >= 14


def test_schemathesis_all_checks_stateful(tcp_daemon, tmp_path):
    examples = os.environ.get("CORRAL_FUZZ_EXAMPLES", "25")
    seed = os.environ.get("CORRAL_FUZZ_SEED", "20261201")
    har = tmp_path / "fuzz.har"
    with client(tcp_daemon.socket_path) as c:
        made = c.post("/v1/sandboxes/batch", json={"count": 6})
        assert made.status_code == 201, made.text
    ids = [s["id"] for s in made.json()["sandboxes"]]
    config = tmp_path / "schemathesis.toml"
    config.write_text((HERE / "fuzz" / "schemathesis.toml").read_text().replace(
        '"@SANDBOXES@"', ", ".join(f'"{i}"' for i in ids[:3])).replace(
        '"@DOOMED@"', ", ".join(f'"{i}"' for i in ids[3:])))
    # One worker: hypothesis parses lambdas with ast.parse, which CPython before 3.11.8 cannot
    # run in two threads at once ("AST constructor recursion depth mismatch").
    workers = "2" if sys.version_info >= (3, 11, 8) else "1"
    argv = [str(ST), "--config-file", str(config), "run",
            SPEC_PATH, "--url", f"http://127.0.0.1:{tcp_daemon.port}",
            "-H", f"Authorization: Bearer {tcp_daemon.token}",
            "--max-examples", examples, "--request-timeout", "30", "--workers", workers,
            "--no-color", "--report", "har", "--report-har-path", str(har)]
    if seed != "random":
        argv += ["--seed", seed]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="hooks",
               PYTHONPATH=os.pathsep.join([str(HERE / "fuzz"), os.environ.get("PYTHONPATH", "")]))
    # A fresh working directory: no example database from an earlier run replays old ids.
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=3600)
    report = out.stdout[-20000:]
    assert out.returncode == 0, report
    ok = _accepted(har)
    print("\naccepted (2xx) generated requests per operation:")
    for r in ROUTES:
        print(f"  {ok[r.handler.__name__]:6d}  {r.method} {r.path}")
    missing = [group for group, names in MUST_REACH.items() if not any(ok[n] for n in names)]
    assert not missing, f"never reached with a valid request: {missing}\n{report}"
    log = Path(tcp_daemon.log_path).read_text(errors="replace")
    assert "Traceback" not in log and '"unhandled error"' not in log, log[-5000:]
    # Everything it made goes with a kill of each (the daemon's stop checks the rest).
    with client(tcp_daemon.socket_path) as c:
        ids = [s["id"] for s in c.get("/v1/sandboxes", params={"limit": 10000}).json()[
            "sandboxes"]]
        if ids:
            assert c.post("/v1/sandboxes/batch/destroy", json={"ids": ids}).status_code == 200
