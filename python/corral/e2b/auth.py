"""Who may call the front.

The control plane takes the front's API key in ``X-API-KEY`` (the header the e2b SDK sends
``E2B_API_KEY`` in). Every envd call names its sandbox (``E2b-Sandbox-Id``) and carries that
sandbox's access token (``X-Access-Token``), which the control plane hands out with the
sandbox: an HMAC of the id under a key derived from the API key, so tokens stay valid across
restarts of the front and one sandbox's token opens no other sandbox.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

API_KEY_HEADER = "X-API-KEY"
ACCESS_TOKEN_HEADER = "X-Access-Token"
SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
MIN_KEY_LEN = 16


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
        return got is not None and hmac.compare_digest(got.encode(), self._api_key)

    def access_token(self, sandbox_id: str) -> str:
        return hmac.new(self._token_key, sandbox_id.encode(), hashlib.sha256).hexdigest()

    def access_token_ok(self, sandbox_id: str, got: str | None) -> bool:
        return got is not None and hmac.compare_digest(got.encode(),
                                                       self.access_token(sandbox_id).encode())
