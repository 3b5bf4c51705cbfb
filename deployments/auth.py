"""API keys: optional bearer-token auth on the HTTP API, as vLLM's ``--api-key``.

With keys configured, every HTTP request but ``GET /health`` (probes must reach it without a secret)
needs ``Authorization: Bearer <key>`` with one of them; otherwise it gets 401 with an OpenAI error
body (``type: invalid_request_error, code: invalid_api_key``, what OpenAI answers) and
``WWW-Authenticate: Bearer``. Python handle calls are not HTTP and are not checked: they come from
inside the cluster.

Where the keys come from: the app argument ``api_keys`` when it is given (a list; ``[]`` turns auth
off even with the variable set), else the environment variable ``APT_SERVE_API_KEYS``
(comma-separated) where the app is built. The variable keeps keys out of ``serve_config.yaml``.

The presented key is compared with every configured key by ``hmac.compare_digest`` (constant time,
and no early exit on the first match), so the answer's timing says nothing about how much of a key
was right. Keys are held as ``SecretStr``: reprs and logs of the options show ``**********``.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence
from typing import Optional

from pydantic import SecretStr
from starlette.responses import JSONResponse

from deployments import openai_protocol as oai

ENV_VAR = "APT_SERVE_API_KEYS"
OPEN_PATHS = frozenset({"/health"})


def resolve_keys(given: Optional[Sequence[SecretStr | str]], environ: Mapping[str, str] = os.environ
                 ) -> tuple[SecretStr, ...]:
    """The keys in force: ``given`` if not None, else the comma-separated environment variable."""
    if given is None:
        given = [k for k in environ.get(ENV_VAR, "").split(",") if k.strip()]
    keys = tuple(k if isinstance(k, SecretStr) else SecretStr(k.strip()) for k in given)
    if any(not k.get_secret_value() for k in keys):
        raise ValueError("api_keys: keys must not be empty")
    return keys


class ApiKeys:
    """The configured keys of one router; ``enabled`` only when there is at least one."""

    def __init__(self, keys: Sequence[SecretStr] = ()) -> None:
        self._keys = [k.get_secret_value().encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def is_valid(self, authorization: str | None) -> bool:
        if not self.enabled:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = token.strip().encode()
        # Every key compared, the result folded without a short cut: constant time in which key matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key)
        return matched

    def check(self, path: str, authorization: str | None) -> oai.APIError | None:
        """None when the request may go on, else the 401 to answer."""
        if path in OPEN_PATHS or self.is_valid(authorization):
            return None
        message = ("Incorrect API key provided" if authorization else
                   "You didn't provide an API key: send it as 'Authorization: Bearer <key>'")
        return oai.APIError(message, status=401, type="invalid_request_error", code="invalid_api_key")


# One router per Serve replica process: the router installs its keys here when it starts, and the
# middleware reads them. (Serve ships the router class by value but this module by reference, so both
# see this one variable; the FastAPI app itself is a frozen copy the router cannot reach.)
_installed = ApiKeys()


def install(keys: ApiKeys) -> None:
    global _installed
    _installed = keys


class ApiKeyMiddleware:
    """A plain ASGI middleware (not ``BaseHTTPMiddleware``, which would get between a streaming
    response and the client's disconnect, and so the engine's abort)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _installed.enabled:
            path, root = scope["path"], scope.get("root_path", "")
            path = path[len(root):] if root and path.startswith(root) else path
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization")
            error = _installed.check(path, authorization.decode("latin-1") if authorization is not None else None)
            if error is not None:
                await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)
