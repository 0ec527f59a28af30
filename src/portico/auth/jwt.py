"""JSON Web Tokens from an OpenID provider (or any JWKS), verified with PyJWT's algorithms.

Keys come from the issuer's discovery document (`jwks_uri`) or an explicit JWKS
URL. They are cached: a token naming a `kid` the cache lacks refetches the set,
at most once per `refresh_interval`, one fetch at a time, each with a deadline,
so a provider that is down or a client inventing `kid`s costs a handshake its
401 and never stampedes the provider. Tokens and claims are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp
import jwt

from portico.auth.base import Identity, IdentityAuthenticator
from portico.auth.jws import ClaimRules, check_claims, parse_compact, verify_signature
from portico.auth.jwt_cache import TimeWindow, Verified, VerifiedTokens, token_digest
from portico.errors import IdentityProviderUnavailable, Unauthenticated

log = logging.getLogger("portico.auth")
DISCOVERY_PATH = "/.well-known/openid-configuration"
MAX_DOCUMENT_BYTES = 1024 * 1024  # a discovery document or a key set
FetchJson = Callable[[str, float], Awaitable[Any]]


async def fetch_json(url: str, deadline: float) -> Any:
    """GET a JSON document; `deadline` seconds bound the whole exchange."""
    client_timeout = aiohttp.ClientTimeout(total=deadline)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as http,
        http.get(url, headers={"Accept": "application/json"}) as response,
    ):
        response.raise_for_status()
        body = await response.content.read(MAX_DOCUMENT_BYTES + 1)
        if len(body) > MAX_DOCUMENT_BYTES:
            raise ValueError("document too large")
        return json.loads(body)


class SigningKey(NamedTuple):
    key: jwt.PyJWK
    alg: str | None  # the JWK's own `alg`, when it names one
    jwk: str  # the JWK as fetched (canonical JSON), to tell an unchanged key on a refetch


class KeySet:
    """The issuer's signing keys by `kid`; refetched on a miss, rate-limited, single-flight."""

    def __init__(
        self,
        *,
        issuer: str,
        jwks_url: str,
        refresh_interval: float,
        timeout: float,
        fetch: FetchJson = fetch_json,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._discovery_url = issuer.rstrip("/") + DISCOVERY_PATH if issuer else ""
        self._jwks_url = jwks_url
        self._refresh_interval = refresh_interval
        self._timeout = timeout
        self._fetch = fetch
        self._clock = clock
        self._keys: dict[str | None, SigningKey] = {}
        self._attempted_at: float | None = None
        self._inflight: asyncio.Future[None] | None = None

    async def key_for(self, kid: str | None) -> SigningKey:
        key = self._lookup(kid)
        if key is None and self._may_refetch():
            await self._refresh()
            key = self._lookup(kid)
        if key is not None:
            return key
        if not self._keys:
            raise IdentityProviderUnavailable()
        raise Unauthenticated("token signed by an unknown key")

    def cached(self, kid: str | None) -> SigningKey | None:
        """The key held now, without fetching: verified-token cache entries check it."""
        return self._lookup(kid)

    def _lookup(self, kid: str | None) -> SigningKey | None:
        if kid is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(kid)

    def _may_refetch(self) -> bool:
        if self._inflight is not None:
            return True  # join the fetch in flight
        last = self._attempted_at
        return last is None or self._clock() - last >= self._refresh_interval

    async def _refresh(self) -> None:
        if self._inflight is None:
            self._attempted_at = self._clock()
            self._inflight = asyncio.ensure_future(self._fetch_keys())
            self._inflight.add_done_callback(self._fetched)
        # Shielded: a handshake that gives up does not cancel the others' fetch.
        await asyncio.shield(self._inflight)

    def _fetched(self, future: asyncio.Future[None]) -> None:
        self._inflight = None

    async def _fetch_keys(self) -> None:
        try:
            url = self._jwks_url or await self._discover()
            keys = parse_key_set(await self._fetch(url, self._timeout))
            if not keys:
                raise ValueError("a key set without usable keys")  # keep the ones cached
            self._keys = self._kept_if_unchanged(keys)
        except Exception as exc:  # a failing provider costs handshakes, never the process
            log.warning("JWKS fetch failed: %s", type(exc).__name__)

    def _kept_if_unchanged(
        self, fetched: dict[str | None, SigningKey]
    ) -> dict[str | None, SigningKey]:
        """A refetch keeps the objects of unchanged keys, so the tokens they verified stay
        cached; a removed or replaced key is a new object and its tokens verify afresh."""
        kept = {}
        for kid, key in fetched.items():
            held = self._keys.get(kid)
            kept[kid] = held if held is not None and held.jwk == key.jwk else key
        return kept

    async def _discover(self) -> str:
        document = await self._fetch(self._discovery_url, self._timeout)
        uri = document.get("jwks_uri") if isinstance(document, dict) else None
        if not isinstance(uri, str) or not uri.startswith(("http://", "https://")):
            raise ValueError("discovery document without jwks_uri")
        self._jwks_url = uri  # discovery is done once; the key set is what rotates
        return uri


def parse_key_set(document: Any) -> dict[str | None, SigningKey]:
    """The signing keys of a JWKS document; keys this library cannot use are skipped."""
    keys: dict[str | None, SigningKey] = {}
    entries = document.get("keys") if isinstance(document, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        try:
            key = jwt.PyJWK(entry)
        except jwt.PyJWTError:
            continue
        kid, alg = entry.get("kid"), entry.get("alg")
        keys[kid if isinstance(kid, str) else None] = SigningKey(
            key, alg if isinstance(alg, str) else None, json.dumps(entry, sort_keys=True)
        )
    return keys


class JwtAuth(IdentityAuthenticator):
    def __init__(
        self,
        keys: KeySet,
        *,
        issuer: str,
        audience: str,
        algorithms: tuple[str, ...],
        leeway: float,
        principal_claim: str,
        session_claim: str,
        cache_entries: int = 0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        self.verified = VerifiedTokens(cache_entries)
        self._now = now  # wall clock: `exp` and `nbf` are Unix times
        self._rules = ClaimRules(issuer=issuer or None, audience=audience or None, leeway=leeway)
        self._algorithms = frozenset(algorithms)
        self._principal_claim = principal_claim
        self._session_claim = session_claim

    async def identify(self, credential: str | None) -> Identity:
        if not credential:
            raise Unauthenticated("missing bearer token")
        digest = token_digest(credential)
        cached = self.verified.get(digest, self._now(), self.keys.cached)
        if cached is not None:
            return cached
        token = parse_compact(credential)
        alg, kid = self._algorithm_and_kid(token.header)
        signing = await self.keys.key_for(kid)
        if signing.alg is not None and signing.alg != alg:
            raise Unauthenticated("token algorithm does not match its key")
        verify_signature(token, alg, signing.key.key)
        now = self._now()
        check_claims(token.claims, self._rules, now)
        window = TimeWindow.of(token.claims, self._rules.leeway)
        window.check(now)  # the rule the cache's hits are judged by
        identity = self._identity(token.claims)
        self.verified.put(digest, Verified(identity, window, kid, signing))
        return identity

    def _algorithm_and_kid(self, header: dict[str, Any]) -> tuple[str, str | None]:
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in self._algorithms:
            raise Unauthenticated("token algorithm not allowed")
        if kid is not None and not isinstance(kid, str):
            raise Unauthenticated("invalid token")
        return alg, kid

    def _identity(self, claims: dict[str, Any]) -> Identity:
        principal = claims.get(self._principal_claim)
        if not isinstance(principal, str) or not principal:
            raise Unauthenticated(f"token lacks the {self._principal_claim!r} claim")
        bound = claims.get(self._session_claim) if self._session_claim else None
        return Identity(
            principal=principal,
            expires_at=float(claims["exp"]),
            session_value=bound if isinstance(bound, str) else "",
            claims=claims,
        )
