"""E2B templates -> what a corral sandbox starts from.

``base`` (the SDK's default template) is the ``host`` image plus E2B's user ``user`` (uid
1000, which nobody else keeps; home /home/user, bash as its shell): built once as a corral
snapshot by running the recipe below in a sandbox, named after the recipe's hash, so a
changed recipe builds anew and every later create starts on it at the cost of a plain
create. Any other template id names a corral snapshot or, failing that, a corral image.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from corral import errors as ce
from corral.sdk.async_sandbox import AsyncSandbox
from corral.sdk.endpoint import Endpoint
from corral.sdk.snapshot import AsyncSnapshot

BASE = "base"
BASE_IMAGE = "host"
BASE_RECIPE = """set -e
# uid/gid 1000 is E2B's user: whoever held them in the host's copy of /etc gives way
for f in /etc/passwd /etc/group; do
  grep -v -E '^user:|^[^:]*:[^:]*:1000:' "$f" > /tmp/.e2b-etc || true
  cat /tmp/.e2b-etc > "$f"
done
rm -f /tmp/.e2b-etc
echo 'user:x:1000:1000::/home/user:/bin/bash' >> /etc/passwd
echo 'user:x:1000:' >> /etc/group
mkdir -p /home/user
chown 1000:1000 /home/user
chmod 0755 /home/user
"""
BASE_SNAPSHOT = "e2b-base-" + hashlib.sha256(
    (BASE_IMAGE + "\0" + BASE_RECIPE).encode()).hexdigest()[:16]


class Templates:
    """Resolves template ids to create arguments; builds ``base`` at most once at a time."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._lock = asyncio.Lock()
        self._base_ready = False
        # One base per credential: a tenant's front cannot see another tenant's snapshot
        # (nor use its name), so each tenant builds and keeps its own.
        auth = endpoint.auth_header()
        self.base_snapshot = BASE_SNAPSHOT if auth is None else \
            f"{BASE_SNAPSHOT}-{hashlib.sha256(auth.encode()).hexdigest()[:12]}"

    async def _build_base(self) -> None:
        async with AsyncSandbox(BASE_IMAGE, endpoint=self._endpoint, timeout=120,
                                labels={"corral.e2b.builder": "1"}) as sb:
            r = await sb.exec(["/bin/sh", "-c", BASE_RECIPE], timeout=60)
            if not r.ok:
                raise ce.InternalError(f"building the base template failed: {r.stderr}")
            await sb.snapshot(self.base_snapshot)

    async def base(self, rebuild: bool = False) -> str:
        """The base template's snapshot name, built if it does not exist."""
        if self._base_ready and not rebuild:
            return self.base_snapshot
        async with self._lock:
            if self._base_ready and not rebuild:
                return self.base_snapshot
            try:
                await AsyncSnapshot.get(self.base_snapshot, endpoint=self._endpoint)
            except ce.SnapshotNotFound:
                try:
                    await self._build_base()
                except ce.SnapshotExists:  # another front built it meanwhile: ready if ours
                    await AsyncSnapshot.get(self.base_snapshot, endpoint=self._endpoint)
            self._base_ready = True
        return self.base_snapshot

    def forget_base(self) -> None:
        self._base_ready = False

    async def create(self, template: str, **spec: Any) -> AsyncSandbox:
        """A new sandbox for ``template`` (ImageNotFound if it names nothing)."""
        if template == BASE:
            try:
                return await AsyncSandbox.create(snapshot=await self.base(),
                                                 endpoint=self._endpoint, **spec)
            except ce.SnapshotNotFound:
                self.forget_base()  # deleted under us: build it again, once
                return await AsyncSandbox.create(snapshot=await self.base(rebuild=True),
                                                 endpoint=self._endpoint, **spec)
        try:
            return await AsyncSandbox.create(snapshot=template, endpoint=self._endpoint,
                                             **spec)
        except (ce.SnapshotNotFound, ce.InvalidRequest):
            return await AsyncSandbox.create(template, endpoint=self._endpoint,
                                             **spec)
