"""Where a pull or push may make the daemon connect (docs/images.md, "Where pulls and
pushes reach").

A tenant names the image reference, and through it the registry whose answers (redirects,
token realms, upload locations) steer the daemon's next requests. None of them may make the
daemon reach what the tenant could not: a port on the host's loopback (a stand-in for the
daemon's own API, Ray's dashboard, a database) or another internal address, nor carry one
registry's credentials to another host. The registries here are small HTTP servers on this
machine; a "canary" is a TCP listener standing for a host-local service: it counts every
connection made to it, TLS attempts included.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import imagefix as fx
import pytest

from corral.errors import Forbidden

from conftest import CGROUP_NAME, private_daemon, wait_until

ADMIN = "admin-token-egress-0123456789"
EVE = "eve-token-egress-0123456789"
BOB = "bob-token-egress-0123456789"
CREDS = ("corral", "registry-secret")
BASIC = "Basic " + base64.b64encode(":".join(CREDS).encode()).decode()


class Canary:
    """A TCP listener: every connection counted, its first bytes kept, a 200 ``{}`` sent."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.addr = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self.seen: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(4096))
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                except OSError:
                    self.seen.append(b"")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(5)


Answer = tuple[int, dict[str, str], Any]  # the body: bytes, or an iterator of chunks


class FakeRegistry:
    """An HTTP server answering each ``METHOD path`` (no query) from ``routes``: an answer
    or a function of the request giving one; 404 for anything else. Every request is kept
    (method, path with query, headers)."""

    def __init__(self) -> None:
        self.routes: dict[str, Answer | Callable[[Any], Answer]] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        reg = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                self.body = self.rfile.read(n) if n else b""
                reg.requests.append((self.command, self.path, dict(self.headers)))
                route = reg.routes.get(f"{self.command} {self.path.split('?')[0]}")
                status, headers, body = (route(self) if callable(route) else route) \
                    if route is not None else (404, {}, b"{}")
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if isinstance(body, bytes):
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                    return
                self.end_headers()  # a stream: its headers say its length
                self.close_connection = True  # a stream cut short ends the connection
                try:
                    for chunk in body:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError:
                    pass

            do_GET = do_HEAD = do_POST = do_PUT = _answer  # noqa: N815

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = int(self.httpd.server_address[1])
        self.addr = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def manifest_for(config: bytes, layers: list[bytes]) -> bytes:
    def desc(b: bytes, media: str) -> dict[str, Any]:
        return {"mediaType": media, "digest": fx_digest(b), "size": len(b)}

    return json.dumps({"schemaVersion": 2,
                       "mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "config": desc(config, "application/vnd.oci.image.config.v1+json"),
                       "layers": [desc(b, "application/vnd.oci.image.layer.v1.tar")
                                  for b in layers]}).encode()


def fx_digest(b: bytes) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(b).hexdigest()


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.c = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"},
                              timeout=120)

    def pull(self, ref: str, timeout: float = 120, progress: bool = False) -> httpx.Response:
        return self.c.post("/v1/images/pull", json={"reference": ref, "progress": progress},
                           timeout=timeout)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        canary = Canary()
        stack.callback(canary.close)
        # Two registries the operator named (plain HTTP allowed, being on loopback: as a
        # registry on the internet would be reachable): the tenant's own, hostile one, and
        # another it sends the daemon to.
        evil, other = FakeRegistry(), FakeRegistry()
        stack.callback(evil.close)
        stack.callback(other.close)
        other.routes["GET /v2/"] = (200, {}, b"{}")
        tokdir = tempfile.mkdtemp(prefix="corral-test-egress-", dir="/var/tmp")
        stack.callback(lambda: __import__("shutil").rmtree(tokdir, ignore_errors=True))
        tokens = os.path.join(tokdir, "tokens.json")
        with open(tokens, "w") as f:
            json.dump({"eve": EVE, "bob": BOB}, f)
        dcfg = os.path.join(tokdir, "docker")
        os.mkdir(dcfg)
        fx.docker_config(dcfg, {evil.addr: CREDS})
        port = fx.free_port()
        d = stack.enter_context(private_daemon(
            "corral-egress-", f"{CGROUP_NAME}-egress", CORRAL_TCP=f"127.0.0.1:{port}",
            CORRAL_TOKEN=ADMIN, CORRAL_TOKENS=tokens, DOCKER_CONFIG=dcfg,
            CORRAL_REGISTRIES="", CORRAL_INSECURE_REGISTRIES=f"{evil.addr},{other.addr}"))
        base = f"http://127.0.0.1:{port}"
        eve, bob, admin = Api(base, EVE), Api(base, BOB), Api(base, ADMIN)
        for api in (eve, bob, admin):
            stack.callback(api.c.close)
        yield {"canary": canary, "evil": evil, "other": other, "eve": eve, "bob": bob,
               "admin": admin, "daemon": d, "port": port}


def _forbidden(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 403, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == "forbidden", err
    return err


def loopback_names() -> list[str]:
    """Names this machine resolves to a loopback address that are not ``localhost``."""
    out = []
    for name in (socket.gethostname(), "ip6-localhost"):
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(name, 80, type=socket.SOCK_STREAM)}
        except OSError:
            continue
        if addrs and all(a.startswith("127.") or a == "::1" for a in addrs):
            out.append(name)
    return out


def test_a_reference_cannot_name_a_host_local_port(env: dict[str, Any]) -> None:
    canary: Canary = env["canary"]
    six = Canary("::1") if socket.has_ipv6 else None
    try:
        hosts = ["127.0.0.1", "localhost", "127.0.0.2", "0.0.0.0", "2130706433",
                 *loopback_names()]
        refs = [f"{h}:{canary.port}/team/app:1" for h in hosts]
        if six is not None:
            refs.append(f"[::1]:{six.port}/team/app:1")
        # and the daemon's own API, where it listens
        refs.append(f"127.0.0.1:{env['port']}/team/app:1")
        for ref in refs:
            err = _forbidden(env["eve"].pull(ref))
            assert "CORRAL_REGISTRIES" in err["message"], err
        # a sandbox's image is pulled the same way
        r = env["eve"].c.post("/v1/sandboxes",
                              json={"image": f"127.0.0.1:{canary.port}/team/app:2"})
        _forbidden(r)
        assert canary.seen == [], canary.seen
        assert six is None or six.seen == [], six.seen
    finally:
        if six is not None:
            six.close()


def test_a_registry_cannot_redirect_the_daemon_to_a_host_local_port(
        env: dict[str, Any]) -> None:
    evil: FakeRegistry = env["evil"]
    canary: Canary = env["canary"]
    to_canary = f"http://127.0.0.1:{canary.port}/latest/meta-data/iam/security-credentials/"
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    man = manifest_for(config, [])
    evil.routes.update({
        "GET /v2/": (200, {}, b"{}"),
        "GET /v2/r/manifests/redirect": (302, {"Location": to_canary}, b""),
        "GET /v2/r/manifests/blob": (200, {"Content-Type":
                                           "application/vnd.oci.image.manifest.v1+json"}, man),
        f"GET /v2/r/blobs/{fx_digest(config)}": (307, {"Location": to_canary}, b""),
        # a redirect to a host the operator named is followed: it must not reach further
        "GET /v2/r/manifests/hop": (302, {"Location": f"http://{env['other'].addr}/hop"}, b""),
    })
    env["other"].routes["GET /hop"] = (302, {"Location": to_canary}, b"")
    for tag in ("redirect", "blob", "hop"):
        err = _forbidden(env["eve"].pull(f"{evil.addr}/r:{tag}"))
        assert err["details"].get("host") == f"127.0.0.1:{canary.port}", err
    assert canary.seen == [], canary.seen


def test_a_token_realm_cannot_point_at_a_host_local_port(env: dict[str, Any]) -> None:
    evil: FakeRegistry = env["evil"]
    canary: Canary = env["canary"]
    for realm in (f"http://127.0.0.1:{canary.port}/token", f"https://localhost:{canary.port}/t"):
        evil.routes["GET /v2/"] = (401, {"WWW-Authenticate": f'Bearer realm="{realm}",'
                                                             'service="x"'}, b"{}")
        err = _forbidden(env["eve"].pull(f"{evil.addr}/r:realm"))
        assert err["details"].get("host") == f"{realm.split('/')[2]}", err
    assert canary.seen == [], canary.seen


def _basic_only(answer: Answer) -> Callable[[Any], Answer]:
    """A route that wants the registry's credentials (401 with a Basic challenge without)."""
    def route(req: Any) -> Answer:
        if req.headers.get("Authorization") != BASIC:
            return 401, {"WWW-Authenticate": 'Basic realm="evil"'}, b"{}"
        return answer
    return route


def test_credentials_go_to_their_registry_only(env: dict[str, Any],
                                               tmp_path: Any) -> None:
    """The daemon holds a login for ``evil``; a redirect or an upload location on another
    host gets neither it nor the token (as Docker does)."""
    evil: FakeRegistry = env["evil"]
    other: FakeRegistry = env["other"]
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    other.routes["GET /config"] = (200, {}, config)
    other.routes["PUT /upload/1"] = (201, {}, b"")
    evil.routes.update({
        "GET /v2/": _basic_only((200, {}, b"{}")),
        "GET /v2/creds/manifests/1": _basic_only(
            (200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
             manifest_for(config, []))),
        f"GET /v2/creds/blobs/{fx_digest(config)}": _basic_only(
            (307, {"Location": f"http://{other.addr}/config"}, b"")),
        "POST /v2/pushed/blobs/uploads/": _basic_only(
            (202, {"Location": f"http://{other.addr}/upload/1"}, b"")),
        "PUT /v2/pushed/manifests/1": _basic_only((201, {}, b"")),
    })
    other.requests.clear()
    r = env["eve"].pull(f"{evil.addr}/creds:1")
    assert any(p == "/config" for _, p, _ in other.requests), (r.text, other.requests)
    # a push (the admin's): the upload goes where the registry says, without the login
    layout = fx.oci_layout("egress", [("gzip", [fx.f("hello", b"hi\n")])])
    unix = f"unix://{env['daemon'].socket_path}"
    from corral.sdk import admin

    admin.import_image("egress-push", layout, endpoint=unix)
    r = env["admin"].c.post("/v1/images/push", json={"name": "egress-push",
                                                     "reference": f"{evil.addr}/pushed:1"})
    assert r.status_code == 200, r.text
    uploads = [h for m, p, h in other.requests if m == "PUT"]
    assert uploads, other.requests
    leaked = [(m, p) for m, p, h in other.requests
              if any(k.lower() == "authorization" for k in h)]
    assert leaked == [], leaked


def test_a_challenge_of_another_host_gets_no_login(env: dict[str, Any]) -> None:
    """A redirect's target or an upload location on another host that answers 401 with a
    Bearer challenge of its own: the daemon answered it with the registry's login (sent to
    that host's token server) and then sent the token on. It is the registry's refusal."""
    evil: FakeRegistry = env["evil"]
    other: FakeRegistry = env["other"]
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    challenge = {"WWW-Authenticate": f'Bearer realm="http://{other.addr}/token",service="x"'}
    other.routes["GET /config401"] = (401, challenge, b"")
    other.routes["PUT /upload/401"] = (401, challenge, b"")
    other.routes["GET /token"] = (200, {}, b'{"token": "stolen"}')
    evil.routes.update({
        "GET /v2/": _basic_only((200, {}, b"{}")),
        "GET /v2/creds401/manifests/1": _basic_only(
            (200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
             manifest_for(config, []))),
        f"GET /v2/creds401/blobs/{fx_digest(config)}": _basic_only(
            (307, {"Location": f"http://{other.addr}/config401"}, b"")),
        "POST /v2/pushed401/blobs/uploads/": _basic_only(
            (202, {"Location": f"http://{other.addr}/upload/401"}, b"")),
    })
    other.requests.clear()
    r = env["eve"].pull(f"{evil.addr}/creds401:1")
    assert r.status_code >= 400 and r.json()["error"]["code"] == "registry_unauthorized", r.text
    layout = fx.oci_layout("egress401", [("gzip", [fx.f("hello", b"hi 401\n")])])
    from corral.sdk import admin

    admin.import_image("egress-401", layout, endpoint=f"unix://{env['daemon'].socket_path}")
    r = env["admin"].c.post("/v1/images/push", json={"name": "egress-401",
                                                     "reference": f"{evil.addr}/pushed401:1"})
    assert r.status_code >= 400 and r.json()["error"]["code"] == "registry_unauthorized", r.text
    assert [p for _, p, _ in other.requests if p.startswith("/token")] == [], other.requests
    leaked = [(m, p) for m, p, h in other.requests
              if any(k.lower() == "authorization" for k in h)]
    assert leaked == [], leaked


def test_the_policy_refuses_every_internal_form_of_an_address() -> None:
    """The check itself, for addresses no test should connect to (no packet leaves this
    machine): nothing here connects; "this host's" is found by binding."""
    import ipaddress

    from corral.daemon.oci.egress import Egress


    blocked = ["198.51.100.0/24"]
    e = Egress(named=["10.9.9.9:5000"], blocked=lambda: blocked)
    refused = ["169.254.169.254", "127.0.0.1", "127.8.9.10", "0.0.0.0", "10.1.2.3",
               "172.16.0.1", "192.168.1.1", "100.64.0.1", "224.0.0.1", "255.255.255.255",
               "::1", "::", "fe80::1", "fd00:ec2::254", "fd20:ce::254", "fc00::1",
               "::ffff:127.0.0.1", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe",
               "2002:7f00:1::", "ff02::1", "198.51.100.7"]
    from test_images_oci import host_ip  # this host's first global IPv4 address

    ip = host_ip()
    if ip is not None:
        refused.append(ip)  # this host's own address: every service listening on all
    for a in refused:
        assert e.why_refused(ipaddress.ip_address(a)) is not None, a
    for a in ("8.8.8.8", "2606:4700::1111", "198.51.101.7"):
        assert e.why_refused(ipaddress.ip_address(a)) is None, a
    blocked.append("8.8.8.0/24")  # the live list is asked again at each check
    assert e.why_refused(ipaddress.ip_address("8.8.8.8")) == "a blocked address"
    # a named registry is reached wherever it is, on its own port only; no port: 80 and 443
    assert e.resolve("10.9.9.9", 5000) == ["10.9.9.9"]
    with pytest.raises(Forbidden):
        e.resolve("10.9.9.9", 5001)
    assert Egress(named=["127.0.0.1"]).resolve("127.0.0.1", 443) == ["127.0.0.1"]
    with pytest.raises(Forbidden):
        Egress(named=["127.0.0.1"]).resolve("127.0.0.1", 8265)
    # plain HTTP: loopback or named insecure, per hop
    assert e.plain_ok("127.0.0.1", 5000) and e.plain_ok("localhost", 1)
    assert not e.plain_ok("10.9.9.9", 5000)
    assert Egress(insecure=["reg.corp:5000"]).plain_ok("reg.corp", 5000)


def _trickled_manifest(stop: threading.Event) -> Callable[[Any], Answer]:
    """A route answering a manifest of 1 MiB a byte every 0.2 s, until ``stop`` is set."""
    def trickle(req: Any) -> Answer:
        def body() -> Iterator[bytes]:
            while not stop.wait(0.2):
                yield b" "
        return 200, {"Content-Type": "application/vnd.oci.image.manifest.v1+json",
                     "Content-Length": str(1 << 20)}, body()
    return trickle


def test_slow_registries_do_not_take_the_daemons_threads(env: dict[str, Any]) -> None:
    """A registry that trickles its answers (a byte now and then, under every read timeout)
    holds each pull as long as it likes; a tenant starting many such pulls (one per tag)
    must not take the threads the rest of the daemon works in: a sandbox is still made."""
    evil: FakeRegistry = env["evil"]
    stop = threading.Event()
    n = 40  # more than the daemon's worker threads (32)

    trickle = _trickled_manifest(stop)

    evil.routes["GET /v2/"] = (200, {}, b"{}")
    for i in range(n):
        evil.routes[f"GET /v2/slow/manifests/{i}"] = trickle

    def started() -> int:
        return sum(1 for m, p, _ in evil.requests if p.startswith("/v2/slow/manifests/"))

    pulls = [threading.Thread(target=env["eve"].pull, args=(f"{evil.addr}/slow:{i}",),
                              daemon=True) for i in range(n)]
    try:
        for t in pulls:
            t.start()
        assert wait_until(lambda: started() >= 4, timeout=30), started()
        # every pull the daemon will run at once has started (without a bound: 32)
        wait_until(lambda: started() >= 32, timeout=10)
        r = env["eve"].c.post("/v1/sandboxes", json={"image": "host"}, timeout=30)
        assert r.status_code == 201, r.text
        assert env["eve"].c.delete(f"/v1/sandboxes/{r.json()['id']}",
                                   timeout=30).status_code == 200
    finally:
        stop.set()
        for t in pulls:
            t.join(60)


def test_a_tenants_slow_pulls_leave_pull_threads_to_other_tenants(env: dict[str, Any]) -> None:
    """Eve starts as many pulls as the daemon has pull threads, from her own registry that
    trickles its manifests: at most images.PULLS_PER_TENANT of them run (or wait for a
    thread); the rest are answered 429 quota_exceeded at once, streamed or not, and Bob's
    pull from another registry is done in seconds. Before, Eve's pulls held all
    PULL_WORKERS threads and Bob's waited behind them (~60 s, the manifest's bound)."""
    from corral.daemon.images import PULL_WORKERS, PULLS_PER_TENANT

    evil: FakeRegistry = env["evil"]
    other: FakeRegistry = env["other"]
    stop = threading.Event()

    trickle = _trickled_manifest(stop)

    evil.routes.clear()
    evil.routes["GET /v2/"] = (200, {}, b"{}")
    for i in range(PULL_WORKERS):
        evil.routes[f"GET /v2/hold/manifests/{i}"] = trickle
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'
    other.routes.update({
        "GET /v2/fine/manifests/1": (200, {"Content-Type":
                                           "application/vnd.oci.image.manifest.v1+json"},
                                     manifest_for(config, [])),
        f"GET /v2/fine/blobs/{fx_digest(config)}": (200, {}, config),
    })

    def started() -> int:
        return sum(1 for m, p, _ in evil.requests if p.startswith("/v2/hold/manifests/"))

    answers: list[httpx.Response] = []

    def pull(i: int) -> None:
        answers.append(env["eve"].pull(f"{evil.addr}/hold:{i}", progress=i % 2 == 1))

    pulls = [threading.Thread(target=pull, args=(i,), daemon=True)
             for i in range(PULL_WORKERS)]
    try:
        for t in pulls:
            t.start()
        # each of Eve's pulls has either reached her registry or been answered
        assert wait_until(lambda: started() + len(answers) >= PULL_WORKERS, timeout=30), \
            (started(), answers)
        r = env["bob"].pull(f"{other.addr}/fine:1", timeout=20)
        assert r.status_code == 201, r.text
        assert started() == PULLS_PER_TENANT, started()
        assert len(answers) == PULL_WORKERS - PULLS_PER_TENANT, answers
        for a in answers:
            assert a.status_code == 429, a.text
            err = a.json()["error"]
            assert err["code"] == "quota_exceeded" and err["infra"], err
            assert err["details"] == {"tenant": "eve", "in_use": PULLS_PER_TENANT,
                                      "limit": PULLS_PER_TENANT, "requested": 1,
                                      "resource": "pulls"}, err
    finally:
        stop.set()
        for t in pulls:
            t.join(90)
    # her pulls ended (failed): her share is whole again
    evil.routes["GET /v2/hold/manifests/0"] = (404, {}, b"{}")
    assert env["eve"].pull(f"{evil.addr}/hold:0").status_code == 404


def test_a_registry_cannot_make_the_daemon_buffer_an_endless_answer(
        env: dict[str, Any]) -> None:
    """Bodies the client never needs (the /v2/ ping's, a redirect's) are not read, and the
    ones it needs (a token) are bounded: a registry streaming 256 MiB into each gets little of
    it taken (the kernel's socket buffers), never the whole into the daemon's memory."""
    evil: FakeRegistry = env["evil"]
    canary_free = f"http://{env['other'].addr}/nowhere"
    sent: dict[str, int] = {}

    def flood(name: str, status: int, headers: dict[str, str]) -> Callable[[Any], Answer]:
        def route(req: Any) -> Answer:
            def body() -> Iterator[bytes]:
                chunk = b"\0" * (1 << 20)
                for _ in range(256):
                    yield chunk
                    sent[name] = sent.get(name, 0) + len(chunk)
            return status, {**headers, "Content-Length": str(256 << 20)}, body()
        return route

    cases = {
        "ping": ("GET /v2/", flood("ping", 200, {})),
        "redirect": ("GET /v2/flood/manifests/1",
                     flood("redirect", 302, {"Location": canary_free})),
        "token": ("GET /token", flood("token", 200, {"Content-Type": "application/json"})),
    }
    for name, (route, answer) in cases.items():
        evil.routes.clear()
        evil.routes["GET /v2/"] = (200, {}, b"{}")
        if name == "token":
            evil.routes["GET /v2/"] = (401, {"WWW-Authenticate":
                                             f'Bearer realm="http://{evil.addr}/token"'}, b"")
        evil.routes[route] = answer
        r = env["eve"].pull(f"{evil.addr}/flood:1")
        assert r.status_code >= 400, r.text
        assert sent.get(name, 0) < 64 << 20, (name, sent)


def test_a_trickled_manifest_or_blob_ends_within_its_bounds(tmp_path: Any) -> None:
    """The registry client itself, with a 1 s timeout: a manifest must be whole within it
    and a blob come at MIN_BLOB_RATE over each second, however steadily a byte arrives."""
    import time

    from corral.daemon.oci import egress, ref, registry
    from corral.errors import ImagePullFailed

    reg = FakeRegistry()
    stop = threading.Event()
    try:
        def trickle(req: Any) -> Answer:
            def body() -> Iterator[bytes]:
                while not stop.wait(0.05):
                    yield b" "
            return 200, {"Content-Length": str(1 << 20)}, body()

        blob = b"x" * (1 << 20)
        reg.routes.update({"GET /v2/": (200, {}, b"{}"), "GET /v2/t/manifests/1": trickle,
                           f"GET /v2/t/blobs/{fx_digest(blob)}": trickle})
        policy = egress.Egress(named=[reg.addr])
        with registry.Registry(ref.parse(f"{reg.addr}/t:1"), policy, timeout=1.0) as r:
            t0 = time.monotonic()
            with pytest.raises(ImagePullFailed, match="not whole after"):
                r.manifest("1")
            with pytest.raises(ImagePullFailed, match="a second"):
                r.blob(fx_digest(blob), len(blob), str(tmp_path / "blob"))
            assert time.monotonic() - t0 < 10
        assert not (tmp_path / "blob").exists()
    finally:
        stop.set()
        reg.close()


def zstd_bomb(blocks: int) -> bytes:
    """One zstd frame of ``blocks`` RLE blocks of 128 KiB each: 4 bytes a block."""
    head = b"\x28\xb5\x2f\xfd" + b"\x00" + bytes([7 << 3])  # no size; a 128 KiB window
    block = lambda last: (int(last) | (1 << 1) | ((128 << 10) << 3)).to_bytes(3, "little") \
        + b"\0"  # noqa: E731
    return head + b"".join(block(i == blocks - 1) for i in range(blocks))


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_content_encoded_answer_is_not_decoded(env: dict[str, Any]) -> None:
    """A manifest sent with ``Content-Encoding: zstd`` (32 KiB that decode to 1 GiB of
    zeros, in one read): the client asks for and reads bodies as sent, so the bound on a
    manifest holds on what arrives and the daemon's memory does not grow by the bomb."""
    import zstandard

    bomb = zstd_bomb(8192)
    assert len(zstandard.ZstdDecompressor().decompressobj().decompress(bomb[:4096])) > 0
    evil: FakeRegistry = env["evil"]
    evil.routes.clear()
    evil.routes["GET /v2/"] = (200, {}, b"{}")
    evil.routes["GET /v2/bomb/manifests/1"] = (200, {"Content-Encoding": "zstd",
                                                     "Content-Type": "application/json"}, bomb)
    pid = env["daemon"].proc.pid
    before = peak_rss_kb(pid)
    r = env["eve"].pull(f"{evil.addr}/bomb:1")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
    grew = peak_rss_kb(pid) - before
    assert grew < 256 << 10, f"the daemon's peak RSS grew by {grew} KiB"
    sent = [h.get("Accept-Encoding") for m, p, h in evil.requests if p.startswith("/v2/bomb")]
    assert sent and all(a == "identity" for a in sent), sent


def test_a_layer_larger_than_the_image_bound_is_not_fetched(env: dict[str, Any]) -> None:
    """A manifest may say a layer is 1 TiB: the blob would be on the node's disk whole before
    its digest could fail. Past the image bound (CORRAL_IMAGE_MAX_BYTES) it is too_large
    before anything is fetched."""
    evil: FakeRegistry = env["evil"]
    config = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers",' \
             b'"diff_ids":["sha256:' + b"0" * 64 + b'"]}}'
    digest = "sha256:" + "ab" * 32
    man = json.dumps({"schemaVersion": 2,
                      "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                 "digest": fx_digest(config), "size": len(config)},
                      "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                  "digest": digest, "size": 1 << 40}]}).encode()

    def zeros(req: Any) -> Answer:
        return 200, {"Content-Length": str(1 << 40)}, (b"\0" * (1 << 20) for _ in range(256))

    evil.routes.clear()
    evil.routes.update({
        "GET /v2/": (200, {}, b"{}"),
        "GET /v2/huge/manifests/1": (200, {"Content-Type":
                                           "application/vnd.oci.image.manifest.v1+json"}, man),
        f"GET /v2/huge/blobs/{fx_digest(config)}": (200, {}, config),
        f"GET /v2/huge/blobs/{digest}": zeros})
    r = env["eve"].pull(f"{evil.addr}/huge:1")
    assert r.json()["error"]["code"] == "too_large", r.text
    assert not any(p == f"/v2/huge/blobs/{digest}" for _, p, _ in evil.requests)
