"""/metrics through prometheus_client's own parser, and the dashboard's API and its
authentication: on TCP nothing but the static page and script is served without the token,
and the local proxy of ``corral dashboard`` is read-only and needs its own token; the page in
real headless Chromium (Debian's), showing what sandboxes print as text, never as HTML."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apiclient import client, create, expect_error, kill, run
from conftest import CGROUP_NAME, SOCKET, free_port, private_daemon, wait_until


def scrape(c: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, labels) -> value."""
    r = c.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
        **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move_with_creates_execs_snapshots_and_errors() -> None:
    with client() as c:
        m0 = scrape(c)
        for name in ("corral_sandboxes", "corral_capacity", "corral_api_waiting",
                     "corral_created_total", "corral_execs_total",  # the names users know
                     "corral_pool_ready", "corral_pools"):
            assert any(k[0] == name for k in m0), name
        sb = create(c, labels={"suite": "observability"})
        try:
            run(c, sb["id"], "echo hi")
            run(c, sb["id"], ["sh", "-c", "exit 3"])
            r = c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={})
            assert r.status_code == 201, r.text
            snap = r.json()["id"]
            m1 = scrape(c)
            assert val(m1, "corral_sandboxes") >= 1
            assert val(m1, "corral_sandboxes_by_state", state="running",
                       substrate=sb["substrate"]) >= 1
            for op, n in (("create", 1), ("exec", 2), ("snapshot", 1)):
                assert val(m1, f"corral_{op}_seconds_count") - \
                    val(m0, f"corral_{op}_seconds_count") >= n, op
                assert val(m1, f"corral_{op}_seconds_sum") > val(m0, f"corral_{op}_seconds_sum")
                # cumulative buckets: +Inf holds every observation
                assert val(m1, f"corral_{op}_seconds_bucket", le="+Inf") == \
                    val(m1, f"corral_{op}_seconds_count")
            assert val(m1, "corral_created_total") > val(m0, "corral_created_total")
            assert c.delete(f"/v1/snapshots/{snap}").status_code == 200
        finally:
            kill(c, sb["id"])

        # Errors, by code: a sandbox that never was, and a body that is not JSON.
        before = scrape(c)
        expect_error(c.post("/v1/sandboxes/nope/exec", json={"cmd": "true"}),
                     "sandbox_not_found", 404)
        expect_error(c.post("/v1/sandboxes", content=b"{not json"), "invalid_request", 400)
        after = scrape(c)
        for code, cat in (("sandbox_not_found", "task"), ("invalid_request", "task")):
            assert val(after, "corral_errors_total", code=code, category=cat) == \
                val(before, "corral_errors_total", code=code, category=cat) + 1, code
        assert val(after, "corral_infra_failures_total", code="sandbox_not_found") == 0


def test_an_infra_failure_is_counted_apart() -> None:
    """An operator's kill of a trajectory's sandbox: the trajectory's next call fails
    sandbox_killed, category infra (the trainer masks it)."""
    tid = uuid.uuid4().hex[:12]
    with client() as c:
        r = c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": f"{tid}:create"})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        kill(c, sid)  # unkeyed: the operator's
        before = scrape(c)
        err = expect_error(c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"},
                                  headers={"Idempotency-Key": f"{tid}:1"}),
                           "sandbox_killed", 409)
        assert err["infra"] is True
        after = scrape(c)
        assert val(after, "corral_infra_failures_total", code="sandbox_killed") == \
            val(before, "corral_infra_failures_total", code="sandbox_killed") + 1
        assert val(after, "corral_errors_total", code="sandbox_killed", category="infra") == \
            val(before, "corral_errors_total", code="sandbox_killed", category="infra") + 1


def test_dashboard_summary_lists_sandboxes_with_labels_age_and_latency() -> None:
    with client() as c:
        sb = create(c, labels={"team": "rl", "run": "7"})
        try:
            run(c, sb["id"], "true")
            d = c.get("/v1/dashboard").json()
            row = next(r for r in d["sandboxes"] if r["id"] == sb["id"])
            assert row["labels"] == {"team": "rl", "run": "7"} and row["state"] == "running"
            assert 0 <= row["age_s"] < 600
            assert d["count"] >= 1 and d["capacity"] >= d["count"]
            assert d["totals"]["execs"] >= 1
            ex = d["latency"]["exec"]
            assert ex["count"] >= 1 and ex["buckets"][-1] == ["+Inf", ex["count"]]
        finally:
            kill(c, sb["id"])


# ---- TCP: the token guards everything but the static page and script --------------------
@pytest.fixture(scope="module")
def tcp_daemon() -> Iterator[Any]:
    port, token = free_port(), secrets.token_hex(16)
    # A static warm pool of 2 for the host image: the pool gauges have something to show.
    with private_daemon("corral-observe-", f"{CGROUP_NAME}-observe", CORRAL_POOL="static",
                        CORRAL_POOL_SIZES="host:2",
                        CORRAL_TCP=f"127.0.0.1:{port}", CORRAL_TOKEN=token) as d:
        d.port, d.token = port, token  # type: ignore[attr-defined]
        yield d


def test_dashboard_on_tcp_needs_the_token_for_every_byte_of_data(tcp_daemon: Any) -> None:
    base = f"http://127.0.0.1:{tcp_daemon.port}"
    good = {"Authorization": f"Bearer {tcp_daemon.token}"}
    with httpx.Client(base_url=base, timeout=60) as c:
        sb = c.post("/v1/sandboxes", json={"labels": {"secret": "s3"}}, headers=good).json()
        try:
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "token=x"},
                        {"Authorization": f"Basic {tcp_daemon.token}"}):
                for path in ("/v1/dashboard", "/metrics", f"/v1/sandboxes/{sb['id']}/log",
                             f"/v1/sandboxes/{sb['id']}", "/dashboard/../v1/dashboard",
                             "/dashboard/%2e%2e/v1/dashboard", "/v1/dashboard?token=x"):
                    r = c.get(path, headers=bad)
                    expect_error(r, "unauthorized", 401)
            # The static files hold nothing of the daemon's: no id, no label.
            for path in ("/dashboard", "/dashboard/app.js"):
                r = c.get(path)
                assert r.status_code == 200
                assert sb["id"] not in r.text and "s3" not in r.text
                csp = r.headers["Content-Security-Policy"]
                assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert c.get("/dashboard").headers["content-type"].startswith("text/html")
            d = c.get("/v1/dashboard", headers=good).json()
            assert any(r["id"] == sb["id"] for r in d["sandboxes"])
        finally:
            c.delete(f"/v1/sandboxes/{sb['id']}", headers=good)


def test_pool_gauges(tcp_daemon: Any) -> None:
    c = httpx.Client(base_url=f"http://127.0.0.1:{tcp_daemon.port}", timeout=60,
                     headers={"Authorization": f"Bearer {tcp_daemon.token}"})
    with c:
        ready = ("corral_pool_sandboxes", (("image", "host"), ("state", "ready"),
                                           ("substrate", "container")))
        assert wait_until(lambda: scrape(c).get(ready) == 2, 60)
        m = scrape(c)
        assert val(m, "corral_pools") == 1 and val(m, "corral_pool_ready") == 2
        sb = c.post("/v1/sandboxes", json={}).json()  # taken from the pool
        try:
            assert val(scrape(c), "corral_pool_hits_total") >= 1
        finally:
            c.delete(f"/v1/sandboxes/{sb['id']}")


def test_cli_prints_the_tcp_url_with_the_token_in_the_fragment(tcp_daemon: Any) -> None:
    env = dict(os.environ, CORRAL_URL=f"http://127.0.0.1:{tcp_daemon.port}",
               CORRAL_TOKEN=tcp_daemon.token)
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    r = subprocess.run([corral, "dashboard"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"http://127.0.0.1:{tcp_daemon.port}/dashboard"
                                f"#token={tcp_daemon.token}")


# ---- the unix socket: `corral dashboard` runs a read-only proxy with its own token --------
@pytest.fixture()
def proxy() -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CORRAL_URL", "CORRAL_TOKEN")}
    env["CORRAL_SOCKET"] = SOCKET
    corral = os.path.join(os.path.dirname(sys.executable), "corral")
    p = subprocess.Popen([corral, "dashboard"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout is not None
        url = p.stdout.readline().strip()  # printed once it listens
        assert url.startswith("http://127.0.0.1:") and "/dashboard#token=" in url, url
        yield url
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_socket_proxy_is_read_only_and_needs_its_own_token(proxy: str) -> None:
    base, _, token = proxy.partition("/dashboard#token=")
    good = {"Authorization": f"Bearer {token}"}
    with client() as uc, httpx.Client(base_url=base, timeout=60) as c:
        sb = create(uc, labels={"via": "proxy"})
        try:
            for bad in ({}, {"Authorization": "Bearer nope"}):
                for path in ("/v1/dashboard", "/metrics", f"/v1/sandboxes/{sb['id']}/log"):
                    expect_error(c.get(path, headers=bad), "unauthorized", 401)
            # Even with its token it only reads: no create, exec, kill, files, images.
            for method, path in (("POST", "/v1/sandboxes"),
                                 ("POST", f"/v1/sandboxes/{sb['id']}/exec"),
                                 ("DELETE", f"/v1/sandboxes/{sb['id']}"),
                                 ("GET", f"/v1/sandboxes/{sb['id']}/files?path=/etc/passwd"),
                                 ("GET", f"/v1/sandboxes/{sb['id']}/files/tar?path=/"),
                                 ("GET", "/v1/images"), ("GET", "/v1/status"),
                                 ("GET", "/v1/sandboxes/x/../../v1/status"),
                                 ("GET", f"/v1/sandboxes/{sb['id']}%2Ffiles?path=/etc/passwd"),
                                 ("GET", f"/v1/sandboxes/{sb['id']}%252Ffiles?path=/etc/pa"),
                                 ("GET", f"/v1/sandboxes/{sb['id']}%2F..%2F..%2Fstatus")):
                r = c.request(method, path, headers=good, json={"cmd": "id"})
                assert r.status_code in (403, 404), (method, path, r.status_code)
            assert c.get("/dashboard").status_code == 200
            d = c.get("/v1/dashboard", headers=good).json()
            assert any(r["id"] == sb["id"] and r["labels"] == {"via": "proxy"}
                       for r in d["sandboxes"])
            log = c.get(f"/v1/sandboxes/{sb['id']}/log", headers=good).json()
            assert log["entries"][0]["op"] == "create"
            assert c.get(f"/v1/sandboxes/{sb['id']}", headers=good).json()["id"] == sb["id"]
            assert uc.get(f"/v1/sandboxes/{sb['id']}").json()["state"] == "running"
        finally:
            kill(uc, sb["id"])


# ---- real headless Chromium (Debian's chromium + chromium-driver) ------------------------
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Debian's chromium and chromium-driver (scripts/setup.sh)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,860",
                 "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-default-apps", "--disable-domain-reliability",
                 "--disable-client-side-phishing-detection", "--no-proxy-server",
                 # nothing leaves the machine: every host but 127.0.0.1 fails to resolve
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


XSS = "<img src=x onerror=window.__pwned=1>"


def test_browser_shows_a_sandbox_and_follows_it_to_its_log(tcp_daemon: Any, browser: Any,
                                                           tmp_path: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    shots = os.environ.get("CORRAL_SCREENSHOT_DIR") or str(tmp_path)
    base = f"http://127.0.0.1:{tcp_daemon.port}"
    good = {"Authorization": f"Bearer {tcp_daemon.token}"}
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    with httpx.Client(base_url=base, timeout=60, headers=good) as c:
        r = c.post("/v1/sandboxes", json={"labels": {"suite": "browser", "note": XSS}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            for cmd in ("echo hello-dashboard", "printf '<b id=injected>bold</b>\\n'",
                        "ls /nonexistent"):
                assert c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd}).status_code == 200

            browser.get(f"{base}/dashboard#token={tcp_daemon.token}")
            row = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"tr[data-id='{sid}']"))
            text = row[0].text
            assert "suite=browser" in text and f"note={XSS}" in text  # shown as text
            assert browser.execute_script("return location.hash") == "#/"  # token gone
            hist = browser.find_element(By.CSS_SELECTOR, ".hist[data-op='exec'] h3").text
            assert re.match(r"exec latency: [1-9]\d* calls, mean ", hist), hist
            browser.save_screenshot(os.path.join(shots, "dashboard.png"))

            row[0].find_element(By.CSS_SELECTOR, "a.sb-link").click()
            term = wait.until(lambda d: (t := d.find_element(By.ID, "terminal")).is_displayed()
                              and "hello-dashboard" in t.text and t)
            assert "$ echo hello-dashboard" in term.text
            assert "<b id=injected>bold</b>" in term.text  # the output, as text
            assert "No such file or directory" in term.text and "[exit 0]" in term.text
            ops = [e.get_attribute("data-op")
                   for e in browser.find_elements(By.CSS_SELECTOR, "#log tbody tr")]
            assert ops[0] == "create" and ops.count("exec") == 3, ops
            assert browser.find_elements(By.ID, "injected") == []
            assert browser.find_elements(By.TAG_NAME, "img") == []
            assert browser.execute_script("return window.__pwned === undefined")
            browser.save_screenshot(os.path.join(shots, "dashboard-sandbox.png"))

            # Another tab's view without the token: the form, and nothing of the daemon's.
            browser.execute_script("sessionStorage.clear()")
            browser.get(f"{base}/dashboard?fresh#/")
            wait.until(lambda d: d.find_element(By.ID, "auth").is_displayed())
            browser.get(f"{base}/dashboard?again#token=wrong")
            wait.until(lambda d: "wrong token" in d.find_element(By.ID, "auth-error").text)
            assert sid not in browser.page_source
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
