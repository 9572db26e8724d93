"""OCI images for the image tests and ``corral bench images``: OCI image layouts written from
a recipe (tar members spelled out, so hostile layers are as easy as honest ones), cached under
/var/cache/corral-test/<name>-<recipe hash>; real registries (Debian's docker-registry,
distribution 2.8) on this machine's own addresses, plain, with htpasswd basic auth or with
token auth (a small token server here signs the JWTs); pushes with skopeo."""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

CACHE = "/var/cache/corral-test"
BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "id", "echo", "stat", "readlink", "env", "pwd", "mkdir", "touch",
           "rm", "test", "true", "grep", "wc", "head", "sleep", "ln", "whoami", "find")
RECIPE_VERSION = 3

# A member: (kind, name, **attrs). kinds: dir file sym link chr fifo raw (a TarInfo as is).
Member = tuple[str, str, dict[str, Any]]


def d(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0,
      xattrs: dict[str, str] | None = None) -> Member:
    return ("dir", name, {"mode": mode, "uid": uid, "gid": gid, "xattrs": xattrs or {}})


def f(name: str, data: bytes | int = b"", mode: int = 0o644, uid: int = 0, gid: int = 0,
      xattrs: dict[str, str] | None = None) -> Member:
    """``data`` as an int: that many zero bytes (streamed, never held)."""
    return ("file", name, {"data": data, "mode": mode, "uid": uid, "gid": gid,
                           "xattrs": xattrs or {}})


def rand(name: str, size: int, seed: int) -> Member:
    """A file of ``size`` pseudo-random (incompressible, reproducible) bytes."""
    return ("file", name, {"rand": (size, seed), "mode": 0o644, "uid": 0, "gid": 0,
                           "xattrs": {}})


def sym(name: str, target: str) -> Member:
    return ("sym", name, {"target": target})


def link(name: str, target: str) -> Member:
    return ("link", name, {"target": target})


def chr_(name: str, major: int, minor: int) -> Member:
    return ("chr", name, {"major": major, "minor": minor})


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


def _tar(members: list[Member], out: Any) -> None:
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        for kind, name, a in members:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            ti.uid, ti.gid = a.get("uid", 0), a.get("gid", 0)
            ti.mode = a.get("mode", 0o644)
            src: Any = None
            if a.get("xattrs"):
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in a["xattrs"].items()}
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif kind == "file" and "rand" in a:
                import random

                size, seed = a["rand"]
                ti.size, src = size, io.BytesIO(random.Random(seed).randbytes(size))
            elif kind == "file":
                data = a["data"]
                if isinstance(data, int):
                    ti.size, src = data, io.BufferedReader(_Zeros(data), 1 << 20)
                else:
                    ti.size, src = len(data), io.BytesIO(data)
            elif kind == "sym":
                ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, a["target"], 0o777
            elif kind == "link":
                ti.type, ti.linkname = tarfile.LNKTYPE, a["target"]
            elif kind == "chr":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, a["major"], a["minor"]
            elif kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            tf.addfile(ti, src)


def busybox_base() -> list[Member]:
    with open(BUSYBOX, "rb") as fh:
        bb = fh.read()
    m = [d("bin"), f("bin/busybox", bb, 0o755), d("etc"), d("tmp", 0o1777), d("root", 0o700),
         d("home"), d("home/app", 0o755, 1000, 1000), d("opt"), d("opt/data"),
         f("opt/data/old", b"from the base layer\n"), f("etc/gone", b"deleted above\n"),
         f("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:"
                         b"/bin/sh\n"),
         f("etc/group", b"root:x:0:\napp:x:1000:\n")]
    m += [sym(f"bin/{a}", "busybox") for a in APPLETS]
    return m


def recipe_hash(obj: Any) -> str:
    h = hashlib.sha256(json.dumps([RECIPE_VERSION, obj], sort_keys=True, default=repr)
                       .encode())
    with open(BUSYBOX, "rb") as fh:
        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()[:16]


def oci_layout(name: str, layers: list[tuple[str, list[Member]]],
               config: dict[str, Any] | None = None, tag: str = "latest") -> str:
    """An OCI image layout dir (cached) with one layer per (compression, members), the
    compression "gzip", "zstd" or "none"; base first."""
    key = recipe_hash([name, [(c, m) for c, m in layers], config, tag])
    path = os.path.join(CACHE, f"{name}-{key}")
    if os.path.isfile(os.path.join(path, "index.json")):
        return path
    os.makedirs(CACHE, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE)
    blobs = os.path.join(tmp, "blobs", "sha256")
    os.makedirs(blobs)

    def put(data: bytes) -> str:
        hexd = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, hexd), "wb") as out:
            out.write(data)
        return "sha256:" + hexd

    descs, diff_ids = [], []
    for comp, members in layers:
        raw = io.BytesIO()
        _tar(members, raw)
        plain = raw.getvalue()
        diff_ids.append("sha256:" + hashlib.sha256(plain).hexdigest())
        if comp == "gzip":
            data, mt = gzip.compress(plain, 6, mtime=0), \
                "application/vnd.oci.image.layer.v1.tar+gzip"
        elif comp == "zstd":
            import zstandard

            data, mt = zstandard.ZstdCompressor().compress(plain), \
                "application/vnd.oci.image.layer.v1.tar+zstd"
        else:
            data, mt = plain, "application/vnd.oci.image.layer.v1.tar"
        descs.append({"mediaType": mt, "digest": put(data), "size": len(data)})
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cfg_b = json.dumps(cfg).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": put(cfg_b), "size": len(cfg_b)},
                "layers": descs}
    man_b = json.dumps(manifest).encode()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(man_b),
        "size": len(man_b), "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    with open(os.path.join(tmp, "index.json"), "w") as out:
        json.dump(index, out)
    with open(os.path.join(tmp, "oci-layout"), "w") as out:
        json.dump({"imageLayoutVersion": "1.0.0"}, out)
    try:
        os.rename(tmp, path)
    except OSError:  # made meanwhile by another session
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def index_layout(name: str, images: list[tuple[str, str, str]]) -> str:
    """An OCI layout whose tag names an image index over (os, arch, image layout) entries."""
    key = recipe_hash([name, images])
    path = os.path.join(CACHE, f"{name}-{key}")
    if os.path.isfile(os.path.join(path, "index.json")):
        return path
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE)
    blobs = os.path.join(tmp, "blobs", "sha256")
    os.makedirs(blobs)
    entries = []
    for os_, arch, src in images:
        with open(os.path.join(src, "index.json")) as fh:
            top = json.load(fh)["manifests"][0]
        for b in os.listdir(os.path.join(src, "blobs", "sha256")):
            shutil.copyfile(os.path.join(src, "blobs", "sha256", b), os.path.join(blobs, b))
        entries.append({"mediaType": top["mediaType"], "digest": top["digest"],
                        "size": top["size"], "platform": {"os": os_, "architecture": arch}})
    idx = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                      "manifests": entries}).encode()
    hexd = hashlib.sha256(idx).hexdigest()
    with open(os.path.join(blobs, hexd), "wb") as out:
        out.write(idx)
    with open(os.path.join(tmp, "index.json"), "w") as out:
        json.dump({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.index.v1+json", "digest": "sha256:" + hexd,
            "size": len(idx), "annotations": {"org.opencontainers.image.ref.name": "latest"}}]},
            out)
    with open(os.path.join(tmp, "oci-layout"), "w") as out:
        json.dump({"imageLayoutVersion": "1.0.0"}, out)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---- registries ----------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Registry:
    def __init__(self, host: str, port: int, root: str, proc: subprocess.Popen,
                 creds: tuple[str, str] | None) -> None:
        self.host, self.port, self.root, self.proc, self.creds = host, port, root, proc, creds
        self.addr = f"{host}:{port}"
        self.log = os.path.join(root, "registry.log")
        self.token_addr: str | None = None  # the token server's host:port (auth "token")

    @property
    def names(self) -> list[str]:
        """What the daemon must be told to reach it on loopback (CORRAL_REGISTRIES): the
        registry and its token server."""
        return [self.addr] + ([self.token_addr] if self.token_addr else [])

    def push(self, layout: str, repo: str, tag: str = "latest", *extra: str) -> None:
        """skopeo copy; ``extra``: e.g. ``--all`` (an index), ``--format v2s2`` (Docker)."""
        preserve = () if "--format" in extra else ("--preserve-digests",)
        cmd = ["skopeo", "copy", "--quiet", *preserve, *extra, "--dest-tls-verify=false",
               "--insecure-policy", f"oci:{layout}:latest", f"docker://{self.addr}/{repo}:{tag}"]
        if self.creds:
            cmd[2:2] = ["--dest-creds", f"{self.creds[0]}:{self.creds[1]}"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120,
                       env={**os.environ, "HOME": self.root})

    def blob_path(self, digest: str) -> str:
        hexd = digest.split(":", 1)[1]
        return os.path.join(self.root, "data", "docker", "registry", "v2", "blobs", "sha256",
                            hexd[:2], hexd, "data")

    def requests(self, needle: str) -> int:
        """Access-log lines that contain ``needle`` (e.g. a blob's GET)."""
        with open(self.log, errors="replace") as fh:
            return sum(1 for line in fh if needle in line and '"GET ' in line)


@contextlib.contextmanager
def registry(host: str = "127.0.0.1", auth: str = "none",
             creds: tuple[str, str] = ("corral", "s3cret"),
             port: int | None = None) -> Iterator[Registry]:
    """A docker-registry on ``host`` (on ``port``, else a free one): auth "none",
    "htpasswd" or "token"."""
    root = tempfile.mkdtemp(prefix="corral-registry-", dir="/var/tmp")
    port = port or free_port(host)
    cfg: dict[str, Any] = {
        "version": 0.1, "log": {"level": "info", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": os.path.join(root, "data")},
                    "delete": {"enabled": True}},
        "http": {"addr": f"{host}:{port}"}}
    token: TokenServer | None = None
    if auth == "htpasswd":
        line = subprocess.run(["htpasswd", "-Bbn", *creds], check=True, capture_output=True,
                              text=True).stdout.strip()
        with open(os.path.join(root, "htpasswd"), "w") as fh:
            fh.write(line + "\n")
        cfg["auth"] = {"htpasswd": {"realm": "corral-test",
                                    "path": os.path.join(root, "htpasswd")}}
    elif auth == "token":
        token = TokenServer(root, creds)
        cfg["auth"] = {"token": {"realm": token.realm, "service": "corral-test",
                                 "issuer": "corral-test-issuer",
                                 "rootcertbundle": token.cert}}
    with open(os.path.join(root, "config.yml"), "w") as fh:
        json.dump(cfg, fh)  # YAML is a superset of JSON
    log = open(os.path.join(root, "registry.log"), "wb")  # noqa: SIM115
    proc = subprocess.Popen(["docker-registry", "serve", os.path.join(root, "config.yml")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    log.close()
    reg = Registry(host, port, root, proc, None if auth == "none" else creds)
    if token is not None:
        reg.token_addr = token.realm.split("/")[2]
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection((host, port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not start: "
                                       + open(reg.log, errors="replace").read()[-2000:]) from None
                time.sleep(0.02)
        yield reg
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if token is not None:
            token.close()
        shutil.rmtree(root, ignore_errors=True)


def _b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


class TokenServer:
    """The token endpoint of the distribution token-auth spec: Basic credentials in, a JWT
    (RS256, its certificate in the x5c header) out, granting what the scope asks."""

    def __init__(self, root: str, creds: tuple[str, str]) -> None:
        self.key = os.path.join(root, "token.key")
        self.cert = os.path.join(root, "token.crt")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                        "2", "-subj", "/CN=corral-test-token", "-keyout", self.key,
                        "-out", self.cert], check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", self.cert, "-outform", "DER"],
                             check=True, capture_output=True).stdout
        self.x5c = base64.b64encode(der).decode()
        self.creds = creds
        self.issued = 0
        server = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                from urllib.parse import parse_qs, urlparse

                q = parse_qs(urlparse(self.path).query)
                want = "Basic " + base64.b64encode(":".join(server.creds).encode()).decode()
                if self.headers.get("Authorization") != want:
                    self.send_response(401)
                    self.end_headers()
                    return
                access = []
                for scope in q.get("scope", []):
                    typ, _, rest = scope.partition(":")
                    name, _, actions = rest.rpartition(":")
                    access.append({"type": typ, "name": name, "actions": actions.split(",")})
                body = json.dumps({"token": server.sign(access)}).encode()
                server.issued += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def sign(self, access: list[dict[str, Any]]) -> str:
        now = int(time.time())
        head = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": "corral-test-issuer", "sub": self.creds[0], "aud": "corral-test",
                  "exp": now + 600, "nbf": now - 60, "iat": now,
                  "jti": os.urandom(8).hex(), "access": access}
        msg = f"{_b64url(json.dumps(head).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", self.key],
                             input=msg.encode(), check=True, capture_output=True).stdout
        return f"{msg}.{_b64url(sig)}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def docker_config(dirpath: str, entries: dict[str, tuple[str, str]]) -> None:
    """Write ``dirpath/config.json`` the way ``docker login`` does."""
    auths = {host: {"auth": base64.b64encode(f"{u}:{p}".encode()).decode()}
             for host, (u, p) in entries.items()}
    tmp = os.path.join(dirpath, ".config.json.tmp")
    with open(tmp, "w") as fh:
        json.dump({"auths": auths}, fh)
    os.rename(tmp, os.path.join(dirpath, "config.json"))
