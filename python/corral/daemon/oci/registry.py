"""A client of the OCI distribution spec: the ``/v2/`` ping that settles the scheme and the
auth challenge, manifests (OCI and Docker v2 schema 2, indexes and manifest lists) and blobs
streamed to a file while hashed; for a push, blob checks, monolithic uploads and manifest
puts. Runs in a worker thread (sync httpx).

Every connection goes through the daemon's egress policy (oci.egress: no internal address
unless the operator named the registry, redirects and token realms checked too). Plain HTTP
only for a registry on loopback or named in the daemon's config
(``CORRAL_INSECURE_REGISTRIES``), and even then HTTPS is tried first, as Docker does. The
registry's credentials (and its token) go to the registry's own origin only."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from corral.daemon.oci import auth, egress
from corral.daemon.oci.ref import Reference
from corral.errors import (
    DigestMismatch,
    ImageNotFound,
    ImagePullFailed,
    InvalidImage,
    RegistryUnauthorized,
)

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_V1 = ("application/vnd.docker.distribution.manifest.v1+json",
             "application/vnd.docker.distribution.manifest.v1+prettyjws")
MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_LIST)
MAX_MANIFEST = 4 << 20
MAX_CONFIG = 8 << 20
# A registry decides how fast it answers, and a byte now and then keeps any read timeout
# from firing: a manifest, a config or a token must be whole within the timeout, and a blob
# must come at this rate at least over every timeout's span (a stalled pull ends).
MIN_BLOB_RATE = 4 << 10  # bytes a second
MAX_TOKEN = 1 << 20  # a token server's answer
MAX_ANSWER = 64 << 10  # the part of a push-side answer read (an error's text)
PLATFORM = ("linux", "amd64")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_digest(digest: str, what: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
        raise InvalidImage(f"{what}: unsupported digest {digest!r} (sha256 only)",
                           details={"digest": digest})
    return hexd


class Registry:
    def __init__(self, ref: Reference, policy: egress.Egress | None = None,
                 timeout: float = 60.0, actions: str = "pull") -> None:
        self.ref = ref
        self.timeout = timeout
        self.actions = actions  # the token scope's: "pull", or "pull,push"
        self.policy = policy if policy is not None else egress.Egress()
        self.plain_ok = ref.loopback() or ref.registry.lower() in self.policy.insecure
        self.base = ""
        self.creds = auth.credentials(ref.registry)  # at pull time: a fresh login counts
        self.client = self.policy.client(httpx.Timeout(timeout, connect=10.0))
        self.authz: str | None = None
        self.scheme = ""  # the challenge's: "basic" | "bearer" | "" (none asked)
        self.params: dict[str, str] = {}

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, msg: str, status: int | None = None) -> ImagePullFailed:
        d: dict[str, Any] = {"registry": self.ref.registry, "reference": str(self.ref)}
        if status is not None:
            d["status"] = status
        return ImagePullFailed(msg, details=d)

    # ---- requests -------------------------------------------------------------------------
    def _open(self, method: str, url: str | httpx.URL, *, headers: dict[str, str] | None = None,
              content: Any = None, params: dict[str, str] | None = None) -> httpx.Response:
        """A streamed response (the caller closes it). GET and HEAD follow redirects (at most
        egress.MAX_REDIRECTS), each hop checked by the policy like the first; a redirect's
        body is never read (httpx's own following reads it whole, however long), and the
        Authorization stays on its origin only."""
        h = dict(headers or {})
        for _ in range(egress.MAX_REDIRECTS + 1):
            req = self.client.build_request(method, url, headers=h, content=content,
                                            params=params)
            r = self.client.send(req, stream=True)
            if not (r.is_redirect and method in ("GET", "HEAD")):
                return r
            r.close()
            try:
                nxt = r.url.join(r.headers["location"])
            except httpx.InvalidURL as e:
                raise httpx.RemoteProtocolError(f"bad redirect {e}", request=req) from e
            if (nxt.scheme, nxt.host, nxt.port) != (r.url.scheme, r.url.host, r.url.port):
                h.pop("Authorization", None)
            url, params = nxt, None
        raise httpx.TooManyRedirects(f"more than {egress.MAX_REDIRECTS} redirects", request=req)

    def _read(self, r: httpx.Response, limit: int, what: str, cut: bool = False) -> bytes:
        """The body of ``r``, whole within the timeout and at most ``limit`` bytes (more:
        InvalidImage, or with ``cut`` the first ``limit``)."""
        deadline = time.monotonic() + self.timeout
        data = bytearray()
        for chunk in r.iter_raw():  # as sent: never decoded (Content-Encoding: a bomb)
            data += chunk
            if len(data) > limit:
                if cut:
                    return bytes(data[:limit])
                raise InvalidImage(f"{what}: larger than {limit} bytes",
                                   details={"limit": limit})
            if time.monotonic() > deadline:
                raise self._fail(f"{what}: not whole after {self.timeout:g} s")
        return bytes(data)

    # ---- scheme and auth ------------------------------------------------------------------
    def ping(self) -> None:
        schemes = ["https", "http"] if self.plain_ok else ["https"]
        last: Exception | None = None
        for scheme in schemes:
            base = f"{scheme}://{self.ref.api_host}"
            try:
                r = self._open("GET", base + "/v2/")
            except httpx.HTTPError as e:
                last = e
                continue
            r.close()  # the status and the challenge are all it says: its body is not read
            self.base = base
            if r.status_code == 401:
                self.scheme, self.params = auth.challenge(r.headers.get("www-authenticate", ""))
            elif r.status_code >= 400 and r.status_code != 404:
                raise self._fail(f"registry {self.ref.registry} answered /v2/ with "
                                 f"{r.status_code}", r.status_code)
            return
        raise self._fail(f"cannot reach registry {self.ref.registry}: {last}"
                         + ("" if self.plain_ok else " (plain HTTP is allowed only for "
                            "registries on 127.0.0.0/8 or named in CORRAL_INSECURE_REGISTRIES)"))

    def _plain_realm(self, realm: str) -> bool:
        """A plain-HTTP token realm gets the credentials only on loopback or a host named
        insecure."""
        try:
            url = httpx.URL(realm)
        except httpx.InvalidURL:
            return False
        return self.policy.plain_ok(url.host, url.port or 80)

    def _own(self, url: str) -> bool:
        """``url`` is on the registry's origin (scheme, host, port): the only one its
        credentials and token go to, as Docker does (an upload Location elsewhere gets
        none)."""
        try:
            a, b = httpx.URL(url), httpx.URL(self.base)
        except httpx.InvalidURL:
            return False
        return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)

    def _unauthorized(self, why: str) -> RegistryUnauthorized:
        hint = "" if self.creds else (f"; no credentials for {self.ref.registry} in "
                                      f"{auth.config_path()}")
        return RegistryUnauthorized(f"registry {self.ref.registry} refused access to "
                                    f"{self.ref.repo}: {why}{hint}",
                                    details={"registry": self.ref.registry,
                                             "reference": str(self.ref)})

    def _login(self) -> None:
        """Answer the challenge once: Basic with the configured credentials, or a Bearer
        token from the realm (with the credentials if any, anonymous otherwise)."""
        if self.scheme == "basic":
            if not self.creds:
                raise self._unauthorized("it asks for basic auth")
            self.authz = httpx.BasicAuth(*self.creds)._auth_header
            return
        if self.scheme != "bearer" or not self.params.get("realm"):
            raise self._unauthorized(f"unsupported challenge {self.scheme!r}")
        realm = self.params["realm"]
        if not realm.startswith("https://") and not (realm.startswith("http://")
                                                     and self._plain_realm(realm)):
            raise self._unauthorized(f"token realm {realm!r} is not HTTPS (plain HTTP only "
                                     "on loopback or a registry named insecure)")
        q = {"scope": f"repository:{self.ref.repo}:{self.actions}"}
        if self.params.get("service"):
            q["service"] = self.params["service"]
        h = {"Authorization": httpx.BasicAuth(*self.creds)._auth_header} if self.creds else {}
        try:
            r = self._open("GET", realm, headers=h, params=q)
            try:
                status = r.status_code
                data = self._read(r, MAX_TOKEN, f"the token server {realm}") \
                    if status == 200 else b""
            finally:
                r.close()
        except httpx.HTTPError as e:
            raise self._fail(f"token server {realm} unreachable: {e}") from e
        if status in (401, 403):
            raise self._unauthorized(f"the token server said {status}")
        if status != 200:
            raise self._fail(f"token server {realm} answered {status}", status)
        try:
            body = json.loads(data)
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise self._fail(f"token server {realm} gave no token")
        self.authz = f"Bearer {token}"

    def _get(self, path: str, accept: str | None = None) -> httpx.Response:
        """GET ``/v2/<repo>/<path>`` streamed (the caller closes it), logging in on a 401."""
        if not self.base:
            self.ping()
        if self.scheme and self.authz is None:
            self._login()
        url = f"{self.base}/v2/{self.ref.repo}/{path}"
        for attempt in range(2):
            headers = {"Accept": accept} if accept else {}
            if self.authz:
                headers["Authorization"] = self.authz
            try:
                r = self._open("GET", url, headers=headers)
            except httpx.HTTPError as e:
                raise self._fail(f"GET {url}: {e}") from e
            if r.status_code == 401 and attempt == 0 and self._own(str(r.url)):
                r.close()
                self.scheme, self.params = auth.challenge(r.headers.get("www-authenticate", ""))
                self._login()
                continue
            # A 401 of another host (a redirect's target) is never answered with this
            # registry's login: its challenge's realm would get the credentials.
            if r.status_code in (401, 403):
                r.close()
                raise self._unauthorized(f"{r.status_code} on {path}")
            if r.status_code == 404:
                r.close()
                raise ImageNotFound(f"{self.ref} not found in {self.ref.registry} "
                                    f"({path.split('/')[0]} missing)",
                                    details={"reference": str(self.ref)})
            if r.status_code != 200:
                r.close()
                raise self._fail(f"GET {path}: registry answered {r.status_code}",
                                 r.status_code)
            return r
        raise AssertionError("unreachable")

    def send(self, method: str, url: str, ok: tuple[int, ...], *,
             headers: dict[str, str] | None = None, content: Any = None) -> httpx.Response:
        """A push-side request (``url``: a path under ``/v2/<repo>/`` or an upload's
        absolute Location), logging in on a 401; a status outside ``ok`` fails."""
        if not self.base:
            self.ping()
        if self.scheme and self.authz is None:
            self._login()
        if not url.startswith(("http://", "https://")):
            url = f"{self.base}/v2/{self.ref.repo}/{url}"
        for attempt in range(2):
            h = dict(headers or {})
            if self.authz and self._own(url):
                h["Authorization"] = self.authz
            if hasattr(content, "seek"):
                content.seek(0)
            try:
                r = self._open(method, url, headers=h, content=content)
                try:
                    text = self._read(r, MAX_ANSWER, f"{method} {url}", cut=True)
                finally:
                    r.close()
            except httpx.HTTPError as e:
                raise self._fail(f"{method} {url}: {e}") from e
            if r.status_code == 401 and attempt == 0 and self._own(url):
                self.scheme, self.params = auth.challenge(r.headers.get("www-authenticate", ""))
                self._login()
                continue
            if r.status_code in (401, 403):
                raise self._unauthorized(f"{r.status_code} on {method} {url}")
            if r.status_code not in ok:
                raise self._fail(f"{method} {url}: registry answered {r.status_code} "
                                 f"{text[:300].decode(errors='replace')}", r.status_code)
            return r
        raise AssertionError("unreachable")

    def blob_size(self, digest: str) -> int | None:
        """The size of blob ``digest`` if the repository has it, else None."""
        r = self.send("HEAD", f"blobs/{digest}", (200, 404))
        if r.status_code == 404:
            return None
        return int(r.headers.get("content-length", "-1"))

    def upload(self, digest: str, path: str) -> None:
        """Send the file ``path`` as blob ``digest`` in one PUT (the registry verifies it)."""
        r = self.send("POST", "blobs/uploads/", (202,))
        loc = r.headers.get("location", "")
        if not loc:
            raise self._fail("the registry gave no upload location")
        if loc.startswith("/"):
            loc = self.base + loc
        loc += ("&" if "?" in loc else "?") + "digest=" + digest  # keeps the upload's state
        with open(path, "rb") as f:
            self.send("PUT", loc, (201,), content=f,
                      headers={"Content-Type": "application/octet-stream",
                               "Content-Length": str(os.fstat(f.fileno()).st_size)})

    def put_manifest(self, tag: str, data: bytes, media_type: str) -> None:
        self.send("PUT", f"manifests/{tag}", (201,), content=data,
                  headers={"Content-Type": media_type})

    def _small(self, path: str, limit: int, accept: str | None = None) -> tuple[bytes, str]:
        r = self._get(path, accept)
        try:
            data = self._read(r, limit, f"GET {path}")
            return data, r.headers.get("content-type", "").split(";")[0].strip()
        except httpx.HTTPError as e:
            raise self._fail(f"GET {path}: {e}") from e
        finally:
            r.close()

    # ---- manifests and blobs --------------------------------------------------------------
    def manifest(self, reference: str) -> tuple[dict, str, str]:
        """(manifest, media type, its digest) for a tag or digest, an index resolved to its
        linux/amd64 image. A digest-pinned fetch is verified."""
        accept = ", ".join((*MANIFESTS, *INDEXES))
        for _ in range(2):  # an index, then the manifest it points at
            data, ctype = self._small(f"manifests/{reference}", MAX_MANIFEST, accept)
            digest = "sha256:" + sha256_hex(data)
            if reference.startswith("sha256:") and reference != digest:
                raise DigestMismatch(f"manifest {reference} hashes to {digest}",
                                     details={"expected": reference, "got": digest})
            try:
                doc = json.loads(data)
            except ValueError as e:
                raise InvalidImage(f"manifest of {self.ref} is not JSON") from e
            if not isinstance(doc, dict):
                raise InvalidImage(f"manifest of {self.ref} is not an object")
            mtype = doc.get("mediaType") or ctype
            if mtype in DOCKER_V1 or doc.get("schemaVersion") == 1:
                raise InvalidImage(f"{self.ref} has a schema-1 manifest (unsupported; push it "
                                   "again with a current tool)")
            if mtype in INDEXES or (not mtype and "manifests" in doc):
                reference = pick_platform(doc, str(self.ref))
                continue
            if mtype in MANIFESTS or (not mtype and "layers" in doc):
                return doc, mtype or OCI_MANIFEST, digest
            raise InvalidImage(f"{self.ref}: unsupported manifest type {mtype!r}")
        raise InvalidImage(f"{self.ref}: an index that points at an index")

    def config(self, digest: str) -> dict:
        hexd = check_digest(digest, "config")
        data, _ = self._small(f"blobs/{digest}", MAX_CONFIG)
        if sha256_hex(data) != hexd:
            raise DigestMismatch(f"config blob {digest} does not match its digest",
                                 details={"expected": digest})
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise InvalidImage(f"config of {self.ref} is not JSON") from e
        if not isinstance(doc, dict):
            raise InvalidImage(f"config of {self.ref} is not an object")
        return doc

    def blob(self, digest: str, size: int, dest: str,
             progress: Callable[[int], None] | None = None) -> None:
        """Stream blob ``digest`` to the new file ``dest``, verifying size and digest; on any
        failure ``dest`` is removed."""
        hexd = check_digest(digest, "layer")
        h = hashlib.sha256()
        got = 0
        ok = False
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            r = self._get(f"blobs/{digest}")
            span, floor = self.timeout, int(MIN_BLOB_RATE * self.timeout)
            since, at = time.monotonic(), 0
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    # as received (a 1 MiB chunker would wait for 1 MiB however slow), and
                    # never decoded: a Content-Encoding would be a bomb past every bound
                    for chunk in r.iter_raw():
                        got += len(chunk)
                        now = time.monotonic()
                        if now - since >= span:
                            if got - at < floor:
                                raise self._fail(f"blob {digest}: {got - at} bytes in "
                                                 f"{now - since:.0f} s (at least "
                                                 f"{MIN_BLOB_RATE} a second)")
                            since, at = now, got
                        if got > size:
                            raise DigestMismatch(f"blob {digest} is larger than the {size} "
                                                 "bytes its descriptor says",
                                                 details={"expected": digest, "size": size})
                        h.update(chunk)
                        f.write(chunk)
                        if progress is not None:
                            progress(len(chunk))
            except httpx.HTTPError as e:
                raise self._fail(f"blob {digest}: {e}") from e
            finally:
                r.close()
            if got != size or h.hexdigest() != hexd:
                raise DigestMismatch(f"blob {digest} does not match its digest "
                                     f"(got sha256:{h.hexdigest()}, {got} bytes)",
                                     details={"expected": digest,
                                              "got": "sha256:" + h.hexdigest()})
            ok = True
        finally:
            os.close(fd)
            if not ok:
                try:
                    os.unlink(dest)
                except OSError:
                    pass


def pick_platform(index: dict, ref: str) -> str:
    """The digest of the linux/amd64 manifest in an index (the first if several)."""
    items = index.get("manifests")
    if not isinstance(items, list):
        raise InvalidImage(f"{ref}: index without manifests")
    seen = []
    for m in items:
        if not isinstance(m, dict):
            continue
        p = m.get("platform") or {}
        seen.append(f"{p.get('os')}/{p.get('architecture')}")
        if (p.get("os"), p.get("architecture")) == PLATFORM and isinstance(m.get("digest"), str):
            check_digest(m["digest"], "manifest")
            return str(m["digest"])
    raise InvalidImage(f"{ref} has no linux/amd64 image (it has: {', '.join(seen) or 'none'})",
                       details={"platforms": seen})
