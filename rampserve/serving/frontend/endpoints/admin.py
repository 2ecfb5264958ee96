"""Who may change what a server serves: the admin routes (applications, model loading) need the admin token
when the server has one."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from rampserve.serving.shared.protocol import ProtocolError


@dataclass(frozen=True)
class AdminToken:
    """A FastAPI dependency of the admin routes: with a token, a request must send `Authorization: Bearer
    <token>`; None leaves them open, which a server allows on loopback alone (`server.check_admin_access`)."""

    token: str | None

    async def __call__(self, request: Request) -> None:
        if self.token is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ProtocolError("this endpoint needs the admin token: send 'Authorization: Bearer <token>'", 401)
        # Constant time: how long the comparison takes tells nothing of the token
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            raise ProtocolError("the admin token is wrong", 403)
