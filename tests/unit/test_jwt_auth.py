"""`auth: jwt`: locally minted tokens against a JWKS served on 127.0.0.1.

Every rejection has its test; key caching and the once-per-interval refetch on an
unknown `kid` are counted at the key server. Time for the refetch interval is an
injected clock, never a sleep.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Iterator

import jwt
import pytest

from portico.auth.base import Identity, subprotocol_token
from portico.auth.jwt import JwtAuth, KeySet
from portico.config import Settings, load_settings
from portico.errors import ConfigError, IdentityProviderUnavailable, Unauthenticated
from portico.server.websocket import selected_subprotocol
from support.jwks import AUDIENCE, Issuer

INTERVAL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def served() -> Iterator[Issuer]:
    issuer = Issuer().start()
    yield issuer
    issuer.stop()


@pytest.fixture
def issuer(served: Issuer) -> Issuer:
    served.fetches.update(discovery=0, jwks=0)
    served.down = served.stall = False
    if {alg for alg, _ in served.keys.values()} != {"RS256", "ES256", "EdDSA"}:
        served.keys.clear()
        for alg in ("RS256", "ES256", "EdDSA"):
            served.add_key(alg)
    return served


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_auth(
    issuer: Issuer,
    clock: Clock,
    *,
    jwks_url: str = "",
    algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA"),
    leeway: float = 30.0,
    session_claim: str = "",
    timeout: float = 5.0,
    cache_entries: int = 0,
    now: Callable[[], float] = time.time,
) -> JwtAuth:
    keys = KeySet(
        issuer=issuer.url,
        jwks_url=jwks_url,
        refresh_interval=INTERVAL,
        timeout=timeout,
        clock=clock,
    )
    return JwtAuth(
        keys,
        issuer=issuer.url,
        audience=AUDIENCE,
        algorithms=algorithms,
        leeway=leeway,
        principal_claim="sub",
        session_claim=session_claim,
        cache_entries=cache_entries,
        now=now,
    )


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def refused(auth: JwtAuth, token: str | None) -> str:
    with pytest.raises(Unauthenticated) as exc:
        await auth.identify(token)
    return exc.value.message


# -- acceptance -----------------------------------------------------------------------


@pytest.mark.parametrize("alg", ["RS256", "ES256", "EdDSA"])
async def test_a_valid_token_is_its_subjects_identity_with_expiry_and_claims(
    issuer: Issuer, clock: Clock, alg: str
) -> None:
    auth = make_auth(issuer, clock)
    exp = int(time.time()) + 120
    identity = await auth.identify(issuer.token(alg, exp=exp, scope="chat"))
    assert isinstance(identity, Identity)
    assert identity.principal == "alice"
    assert identity.expires_at == exp
    assert identity.claims["scope"] == "chat"
    assert identity.session_value == ""
    assert await auth.authenticate(issuer.token(alg, sub="bob")) == "bob"


async def test_the_session_claim_value_is_carried(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, session_claim="sid")
    assert (await auth.identify(issuer.token(sid="s-1"))).session_value == "s-1"
    assert (await auth.identify(issuer.token())).session_value == ""


async def test_leeway_admits_clock_skew_and_no_more(issuer: Issuer, clock: Clock) -> None:
    late = issuer.token(exp=int(time.time()) - 10)
    assert (await make_auth(issuer, clock, leeway=30).identify(late)).principal == "alice"
    assert await refused(make_auth(issuer, clock, leeway=0), late) == "token expired"


# -- every rejection ------------------------------------------------------------------


async def test_expired(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(exp=int(time.time()) - 120)
    assert await refused(make_auth(issuer, clock), token) == "token expired"


async def test_not_yet_valid(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(nbf=int(time.time()) + 120)
    assert await refused(make_auth(issuer, clock), token) == "token not yet valid"


async def test_wrong_issuer(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(iss="https://elsewhere.example")
    assert await refused(make_auth(issuer, clock), token) == "token issuer not accepted"


async def test_wrong_audience(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(aud="another-api")
    assert await refused(make_auth(issuer, clock), token) == "token audience not accepted"


async def test_an_algorithm_outside_the_allow_list(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, algorithms=("ES256",))
    assert await refused(auth, issuer.token("RS256")) == "token algorithm not allowed"


async def test_alg_none_is_never_accepted(issuer: Issuer, clock: Clock) -> None:
    unsigned = jwt.encode(issuer.claims(), None, algorithm="none", headers={"kid": "rs256-1"})
    assert await refused(make_auth(issuer, clock), unsigned) == "token algorithm not allowed"
    with pytest.raises(ConfigError):
        Settings(auth="jwt", jwt_issuer=issuer.url, jwt_algorithms=("none",)).check_startable()


async def test_hs256_signed_with_the_public_key_is_refused(issuer: Issuer, clock: Clock) -> None:
    """Algorithm confusion: the RSA public key used as an HMAC secret."""
    kid = issuer.kid("RS256")
    secret = json.dumps(issuer.jwks()["keys"][0]).encode()
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    payload = b64(json.dumps(issuer.claims()).encode())
    mac = hmac.new(secret, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    forged = f"{header}.{payload}.{b64(mac)}"
    assert await refused(make_auth(issuer, clock), forged) == "token algorithm not allowed"
    with pytest.raises(ConfigError, match="HS256"):
        Settings(auth="jwt", jwt_issuer=issuer.url, jwt_algorithms=("HS256",)).check_startable()


async def test_an_algorithm_other_than_its_keys_is_refused(issuer: Issuer, clock: Clock) -> None:
    """A token claiming ES256 under the RSA key's kid."""
    auth = make_auth(issuer, clock)
    _, ec_key = issuer.keys[issuer.kid("ES256")]
    forged = jwt.encode(
        issuer.claims(), ec_key, algorithm="ES256", headers={"kid": issuer.kid("RS256")}
    )
    assert await refused(auth, forged) == "token algorithm does not match its key"


async def test_unknown_kid(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock)
    stranger = Issuer(algorithms=("RS256",))
    token = jwt.encode(
        issuer.claims(), stranger.keys["rs256-1"][1], algorithm="RS256", headers={"kid": "nope"}
    )
    assert await refused(auth, token) == "token signed by an unknown key"


async def test_tampered_payload(issuer: Issuer, clock: Clock) -> None:
    header, _, signature = issuer.token().split(".")
    payload = b64(json.dumps(issuer.claims(sub="mallory")).encode())
    tampered = f"{header}.{payload}.{signature}"
    assert await refused(make_auth(issuer, clock), tampered) == "token signature invalid"


async def test_signed_by_another_key_under_a_known_kid(issuer: Issuer, clock: Clock) -> None:
    stranger = Issuer(algorithms=("RS256",))
    forged = jwt.encode(
        issuer.claims(),
        stranger.keys["rs256-1"][1],
        algorithm="RS256",
        headers={"kid": issuer.kid("RS256")},
    )
    assert await refused(make_auth(issuer, clock), forged) == "token signature invalid"


async def test_missing_principal_claim(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(sub=None)
    assert await refused(make_auth(issuer, clock), token) == "token lacks the 'sub' claim"


async def test_missing_exp(issuer: Issuer, clock: Clock) -> None:
    token = issuer.token(exp=None)
    assert await refused(make_auth(issuer, clock), token) == "token lacks a required claim"


@pytest.mark.parametrize("credential", [None, "", "not-a-jwt", "a.b.c"])
async def test_missing_or_malformed(issuer: Issuer, clock: Clock, credential: str | None) -> None:
    message = await refused(make_auth(issuer, clock), credential)
    assert message in {"missing bearer token", "invalid token"}
    assert issuer.fetches["jwks"] == 0  # nothing to verify: the provider is not asked


# -- key caching ------------------------------------------------------------------------


async def test_keys_are_discovered_once_and_cached(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock)
    for alg in ("RS256", "ES256", "EdDSA", "RS256"):
        await auth.identify(issuer.token(alg))
    assert issuer.fetches == {"discovery": 1, "jwks": 1}


async def test_an_explicit_jwks_url_skips_discovery(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    await auth.identify(issuer.token())
    assert issuer.fetches == {"discovery": 0, "jwks": 1}


async def test_an_unknown_kid_refetches_at_most_once_per_interval(
    issuer: Issuer, clock: Clock
) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    await auth.identify(issuer.token())
    bogus = issuer.token(headers={"kid": "made-up"}, kid=issuer.kid("RS256"))
    for _ in range(5):
        await refused(auth, bogus)
    clock.now += INTERVAL / 2
    await refused(auth, bogus)
    assert issuer.fetches["jwks"] == 1  # the first fetch was less than an interval ago
    clock.now += INTERVAL
    await refused(auth, bogus)
    await refused(auth, bogus)
    assert issuer.fetches["jwks"] == 2


async def test_a_rotated_key_is_fetched_once_and_old_keys_go(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    old = issuer.token()
    await auth.identify(old)
    clock.now += INTERVAL
    new_kid = issuer.rotate("ES256")
    for _ in range(3):
        assert (await auth.identify(issuer.token("ES256", kid=new_kid))).principal == "alice"
    assert issuer.fetches["jwks"] == 2
    assert await refused(auth, old) == "token signed by an unknown key"


async def test_concurrent_handshakes_share_one_fetch(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    identities = await asyncio.gather(*(auth.identify(issuer.token()) for _ in range(20)))
    assert {identity.principal for identity in identities} == {"alice"}
    assert issuer.fetches["jwks"] == 1


# -- a provider that fails --------------------------------------------------------------


async def test_a_provider_that_is_down_costs_a_401_and_no_stampede(
    issuer: Issuer, clock: Clock
) -> None:
    issuer.down = True
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    results = await asyncio.gather(
        *(auth.identify(issuer.token()) for _ in range(10)), return_exceptions=True
    )
    assert all(isinstance(result, IdentityProviderUnavailable) for result in results)
    assert issuer.fetches["jwks"] == 1
    await refused(auth, issuer.token())
    assert issuer.fetches["jwks"] == 1  # no retry inside the interval
    issuer.down = False
    clock.now += INTERVAL
    assert (await auth.identify(issuer.token())).principal == "alice"


async def test_a_stalled_provider_is_cut_off_at_the_fetch_deadline(
    issuer: Issuer, clock: Clock
) -> None:
    issuer.stall = True
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url, timeout=0.2)
    results = await asyncio.wait_for(
        asyncio.gather(*(auth.identify(issuer.token()) for _ in range(5)), return_exceptions=True),
        timeout=10,
    )
    assert all(isinstance(result, IdentityProviderUnavailable) for result in results)
    assert issuer.fetches["jwks"] == 1


async def test_a_discovery_document_without_jwks_uri_is_unavailable(clock: Clock) -> None:
    keys = KeySet(
        issuer="http://127.0.0.1:9", jwks_url="", refresh_interval=INTERVAL, timeout=1, clock=clock
    )
    with pytest.raises(IdentityProviderUnavailable):
        await keys.key_for("any")


# -- settings ---------------------------------------------------------------------------


def test_auth_jwt_without_issuer_or_jwks_url_refuses_to_start() -> None:
    with pytest.raises(ConfigError, match="auth=jwt needs jwt_issuer or jwt_jwks_url"):
        Settings(auth="jwt").check_startable()
    Settings(auth="jwt", jwt_jwks_url="https://idp.example/keys").check_startable()


def test_jwt_settings_from_the_environment() -> None:
    settings = load_settings(
        env={
            "PORTICO_AUTH": "jwt",
            "PORTICO_JWT_ISSUER": "https://idp.example",
            "PORTICO_JWT_AUDIENCE": "api",
            "PORTICO_JWT_JWKS_URL": "https://idp.example/keys",
            "PORTICO_JWT_ALGORITHMS": "ES256, EdDSA",
            "PORTICO_JWT_LEEWAY": "5",
            "PORTICO_JWT_PRINCIPAL_CLAIM": "email",
            "PORTICO_JWT_SESSION_CLAIM": "sid",
        }
    )
    assert settings.auth == "jwt"
    assert settings.jwt_algorithms == ("ES256", "EdDSA")
    assert settings.jwt_leeway == 5.0
    assert (settings.jwt_principal_claim, settings.jwt_session_claim) == ("email", "sid")
    defaults = Settings()
    assert defaults.jwt_algorithms == ("RS256", "ES256", "EdDSA")
    assert (defaults.jwt_leeway, defaults.jwt_principal_claim) == (30.0, "sub")
    assert defaults.jwt_session_claim == ""


# -- the browser's subprotocol entry -----------------------------------------------------


def test_the_token_rides_in_a_subprotocol_entry_and_is_never_selected() -> None:
    header = "portico.bearer.abc.def.ghi, omnia"
    assert subprotocol_token(["portico.bearer.abc.def.ghi", "omnia"]) == "abc.def.ghi"
    assert selected_subprotocol(header) == ("omnia",)
    assert selected_subprotocol("omnia, portico.bearer.t") == ("omnia",)
    assert selected_subprotocol("portico.bearer.t") == ()
    assert selected_subprotocol("chat, superchat") == ()  # no token: nothing changes
    assert selected_subprotocol(None) == ()


async def test_a_key_set_without_usable_keys_keeps_the_cached_ones(
    issuer: Issuer, clock: Clock
) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url)
    good = issuer.token()
    await auth.identify(good)
    unknown = issuer.token(headers={"kid": "new"}, kid=issuer.kid("RS256"))
    saved = dict(issuer.keys)
    issuer.keys.clear()  # the provider now publishes {"keys": []}
    clock.now += INTERVAL
    try:
        assert await refused(auth, unknown) == "token signed by an unknown key"
        assert issuer.fetches["jwks"] == 2
    finally:
        issuer.keys.update(saved)
    assert (await auth.identify(good)).principal == "alice"


# -- the verified-token cache (wall time is an injected clock) ---------------------------


class Wall:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def test_a_repeated_token_is_served_from_the_cache(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, cache_entries=8)
    token = issuer.token("ES256")
    first = await auth.identify(token)
    assert await auth.identify(token) is first
    assert len(auth.verified) == 1


async def test_a_cached_token_past_exp_and_leeway_is_refused(issuer: Issuer, clock: Clock) -> None:
    wall = Wall()
    auth = make_auth(issuer, clock, cache_entries=8, leeway=30, now=wall)
    exp = int(wall.now) + 60
    token = issuer.token(exp=exp)
    await auth.identify(token)
    wall.now = exp + 29.5
    assert (await auth.identify(token)).principal == "alice"  # inside the leeway
    wall.now = exp + 30
    assert await refused(auth, token) == "token expired"
    assert len(auth.verified) == 0


async def test_a_cached_token_before_nbf_is_refused(issuer: Issuer, clock: Clock) -> None:
    wall = Wall()
    auth = make_auth(issuer, clock, cache_entries=8, leeway=0, now=wall)
    token = issuer.token(nbf=int(wall.now))
    await auth.identify(token)
    wall.now -= 1
    assert await refused(auth, token) == "token not yet valid"


async def test_the_cache_is_bounded_and_evicts_the_least_recently_used(
    issuer: Issuer, clock: Clock
) -> None:
    auth = make_auth(issuer, clock, cache_entries=2)
    a, b, c = (issuer.token(sub=name) for name in ("a", "b", "c"))
    held_a = await auth.identify(a)
    held_b = await auth.identify(b)
    assert await auth.identify(a) is held_a  # a is now the most recent
    await auth.identify(c)
    assert len(auth.verified) == 2
    assert await auth.identify(a) is held_a
    assert await auth.identify(b) is not held_b  # evicted, verified afresh


async def test_refused_and_tampered_tokens_are_never_cached(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, cache_entries=8)
    token = issuer.token()
    await auth.identify(token)
    header, payload, signature = token.split(".")
    flipped = signature[:-2] + ("AA" if signature[-2:] != "AA" else "BB")
    forged = b64(json.dumps({**issuer.claims(), "sub": "mallory"}).encode())
    for junk in (f"{header}.{payload}.{flipped}", f"{header}.{forged}.{signature}", token + "x"):
        assert await refused(auth, junk) in ("token signature invalid", "invalid token")
    assert len(auth.verified) == 1


async def test_a_key_rotated_away_drops_its_cached_tokens(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url, cache_entries=8)
    old = issuer.token()
    await auth.identify(old)
    clock.now += INTERVAL
    new_kid = issuer.rotate("ES256")
    await auth.identify(issuer.token("ES256", kid=new_kid))  # the refetch
    assert await refused(auth, old) == "token signed by an unknown key"


async def test_a_refetch_with_the_key_unchanged_keeps_its_cached_tokens(
    issuer: Issuer, clock: Clock
) -> None:
    auth = make_auth(issuer, clock, jwks_url=issuer.jwks_url, cache_entries=8)
    token = issuer.token()
    held = await auth.identify(token)
    clock.now += INTERVAL
    issuer.add_key("RS256")  # a new kid: the set is refetched, the old key still in it
    await auth.identify(issuer.token("RS256", kid=f"rs256-{issuer.generation}"))
    assert issuer.fetches["jwks"] == 2
    assert await auth.identify(token) is held


async def test_cache_entries_zero_caches_nothing(issuer: Issuer, clock: Clock) -> None:
    auth = make_auth(issuer, clock, cache_entries=0)
    token = issuer.token()
    assert await auth.identify(token) is not await auth.identify(token)
    assert len(auth.verified) == 0


async def test_a_flood_of_junk_tokens_evicts_no_verified_entry(
    issuer: Issuer, clock: Clock
) -> None:
    auth = make_auth(issuer, clock, cache_entries=1)
    token = issuer.token()
    held = await auth.identify(token)
    header, payload, signature = token.split(".")
    for n in range(20):
        await refused(auth, f"{header}.{payload}.{signature[:-4]}{n:04d}")
    assert await auth.identify(token) is held
