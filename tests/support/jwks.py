"""Signing keys, locally minted JWTs, and a JWKS/discovery server on 127.0.0.1.

`Issuer` is an identity provider in miniature: it holds RSA, EC and Ed25519 keys,
mints tokens with any claims or header, and serves its discovery document and key
set over real HTTP from a thread (`ThreadedApp`), counting each fetch, so that a
`portico serve` process or a unit test reaches it the same way. `down = True` makes
it answer 503; `stall = True` makes it never answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from support.fake_openai import ThreadedApp
from support.server import ServerProcess

AUDIENCE = "portico-tests"
ALGORITHM_KEYS = {"RS256": "rsa", "ES256": "ec", "EdDSA": "ed25519"}
PrivateKey = rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey


def jwt_server(data_dir: Path, issuer: str, **env: str) -> ServerProcess:
    """`portico serve --auth jwt` (the echo agent) trusting `issuer`, started; `env`: more
    `PORTICO_*` settings."""
    settings = {"PORTICO_JWT_ISSUER": issuer, "PORTICO_JWT_AUDIENCE": AUDIENCE, **env}
    return ServerProcess(
        data_dir, args=("--auth", "jwt", "--runtime", "echo"), env=settings
    ).start()


def new_private_key(kind: str) -> PrivateKey:
    if kind == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)
    if kind == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    return ed25519.Ed25519PrivateKey.generate()


def public_jwk(key: PrivateKey, kid: str, alg: str) -> dict[str, Any]:
    algorithm = jwt.get_algorithm_by_name(alg)
    jwk: dict[str, Any] = json.loads(algorithm.to_jwk(key.public_key()))
    jwk.update(kid=kid, alg=alg, use="sig")
    return jwk


class Issuer:
    def __init__(self, *, algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")) -> None:
        self.keys: dict[str, tuple[str, PrivateKey]] = {}  # kid -> (alg, key)
        self.generation = 0
        for alg in algorithms:
            self.add_key(alg)
        self.fetches = {"discovery": 0, "jwks": 0}
        self.down = False
        self.stall = False
        self._app = web.Application()
        self._app.router.add_get("/.well-known/openid-configuration", self._discovery)
        self._app.router.add_get("/jwks", self._jwks)
        self._server = ThreadedApp(self._app)

    # -- keys and tokens ------------------------------------------------------------------

    def add_key(self, alg: str) -> str:
        self.generation += 1
        kid = f"{alg.lower()}-{self.generation}"
        self.keys[kid] = (alg, new_private_key(ALGORITHM_KEYS[alg]))
        return kid

    def rotate(self, alg: str = "RS256") -> str:
        """A new key set: every old key is gone, one new key of `alg`."""
        self.keys.clear()
        return self.add_key(alg)

    def kid(self, alg: str) -> str:
        return next(kid for kid, (key_alg, _) in self.keys.items() if key_alg == alg)

    def claims(self, **overrides: Any) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.url,
            "aud": AUDIENCE,
            "sub": "alice",
            "iat": now,
            "nbf": now,
            "exp": now + 300,
        }
        claims.update(overrides)
        return {name: value for name, value in claims.items() if value is not None}

    def token(
        self,
        alg: str = "RS256",
        *,
        kid: str | None = None,
        headers: dict[str, Any] | None = None,
        **claims: Any,
    ) -> str:
        kid = kid or self.kid(alg)
        _, key = self.keys[kid]
        return jwt.encode(
            self.claims(**claims), key, algorithm=alg, headers={"kid": kid, **(headers or {})}
        )

    def jwks(self) -> dict[str, Any]:
        return {"keys": [public_jwk(key, kid, alg) for kid, (alg, key) in self.keys.items()]}

    # -- the HTTP side --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    @property
    def jwks_url(self) -> str:
        return self.url + "/jwks"

    def start(self) -> Issuer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _discovery(self, request: web.Request) -> web.StreamResponse:
        self.fetches["discovery"] += 1
        return await self._answer({"issuer": self.url, "jwks_uri": self.jwks_url})

    async def _jwks(self, request: web.Request) -> web.StreamResponse:
        self.fetches["jwks"] += 1
        return await self._answer(self.jwks())

    async def _answer(self, document: dict[str, Any]) -> web.StreamResponse:
        if self.stall:
            await asyncio.sleep(3600)
        if self.down:
            return web.Response(status=503, text="down")
        return web.json_response(document)


def served_issuer() -> Iterator[Issuer]:
    """An issuer serving its keys for as long as a (module-scoped) fixture lasts."""
    served = Issuer().start()
    yield served
    served.stop()
