"""Who may call the front.

The control plane takes the front's API key in ``X-API-KEY`` (the header the e2b SDK sends
``E2B_API_KEY`` in). Every envd call names its sandbox (``E2b-Sandbox-Id``) and carries that
sandbox's access token (``X-Access-Token``), which the control plane hands out with the
sandbox: an HMAC of the id under a key derived from the API key, so tokens stay valid across
restarts of the front and one sandbox's token opens no other sandbox. A token is honoured only
for sandboxes the front made (``FrontSandboxes``): the key's holder can compute one for any id,
and must not reach the daemon's other sandboxes through envd's routes.

Header values are compared as bytes (``surrogateescape``): a value that is not UTF-8 is a wrong
key, never an error.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict

API_KEY_HEADER = "X-API-KEY"
ACCESS_TOKEN_HEADER = "X-Access-Token"
SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
MIN_KEY_LEN = 16
KNOWN_SANDBOXES = 65536


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def new_api_key() -> str:
    return "e2b_" + secrets.token_hex(20)


class Keys:
    def __init__(self, api_key: str) -> None:
        if len(api_key) < MIN_KEY_LEN:
            raise ValueError(f"the API key must be at least {MIN_KEY_LEN} characters")
        self._api_key = api_key.encode()
        self._token_key = hmac.new(self._api_key, b"corral-e2b envd access token",
                                   hashlib.sha256).digest()

    def api_key_ok(self, got: str | None) -> bool:
        return got is not None and hmac.compare_digest(_bytes(got), self._api_key)

    def front_label(self) -> str:
        """The value of the label ``corral.e2b`` on the sandboxes this key makes: a
        fingerprint of the key (it tells nothing of it), so two fronts with different keys
        on one daemon credential see only their own."""
        return hmac.new(self._api_key, b"corral-e2b sandboxes", hashlib.sha256).hexdigest()[:32]

    def access_token(self, sandbox_id: str) -> str:
        return hmac.new(self._token_key, _bytes(sandbox_id), hashlib.sha256).hexdigest()

    def access_token_ok(self, sandbox_id: str, got: str | None) -> bool:
        return got is not None and hmac.compare_digest(_bytes(got),
                                                       self.access_token(sandbox_id).encode())


class FrontSandboxes:
    """Ids of sandboxes known to be the front's (its label, ``Keys.front_label``), most recent
    last.
    A label is set at create and never changes, and ids are never reused, so a positive answer
    stays true; only positives are kept, at most KNOWN_SANDBOXES."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, sandbox_id: str) -> None:
        self._ids[sandbox_id] = None
        self._ids.move_to_end(sandbox_id)
        while len(self._ids) > KNOWN_SANDBOXES:
            self._ids.popitem(last=False)

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self._ids
