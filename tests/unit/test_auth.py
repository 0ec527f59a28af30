"""The auth port: no auth, static API keys, and the bearer header the adapters read."""

from __future__ import annotations

import pytest

from portico.auth.apikey import ApiKeyAuth
from portico.auth.base import Identity, bearer_token
from portico.auth.none import LOCAL_PRINCIPAL, NoAuth
from portico.errors import Unauthenticated

KEYS = {"tok-alice": "alice", "tok-bob": "bob", "tok-team": "team=red"}


# -- none -----------------------------------------------------------------------------


@pytest.mark.parametrize("credential", [None, "", "anything", "tok-alice"])
async def test_no_auth_makes_every_caller_the_local_principal(credential: str | None) -> None:
    assert LOCAL_PRINCIPAL == "local"
    assert await NoAuth().authenticate(credential) == "local"


# -- apikey ---------------------------------------------------------------------------


@pytest.mark.parametrize(("token", "principal"), sorted(KEYS.items()))
async def test_api_key_maps_its_token_to_its_principal(token: str, principal: str) -> None:
    assert await ApiKeyAuth(KEYS).authenticate(token) == principal


@pytest.mark.parametrize(
    "credential",
    [None, "", "tok", "tok-alic", "tok-alice ", "tok-alicex", "TOK-ALICE", "alice", "tök-alice"],
    ids=[
        "none",
        "empty",
        "prefix",
        "shorter",
        "trailing-space",
        "longer",
        "case",
        "principal",
        "non-ascii",
    ],
)
async def test_missing_or_wrong_api_key_is_unauthenticated(credential: str | None) -> None:
    with pytest.raises(Unauthenticated) as refused:
        await ApiKeyAuth(KEYS).authenticate(credential)
    assert (refused.value.code, refused.value.http_status) == ("UNAUTHENTICATED", 401)
    assert refused.value.message == "missing or invalid API key"


async def test_api_keys_are_copied_so_later_changes_do_not_grant_access() -> None:
    keys = dict(KEYS)
    auth = ApiKeyAuth(keys)
    keys["tok-eve"] = "eve"
    del keys["tok-alice"]
    assert await auth.authenticate("tok-alice") == "alice"
    with pytest.raises(Unauthenticated):
        await auth.authenticate("tok-eve")


async def test_no_keys_admit_nobody() -> None:
    with pytest.raises(Unauthenticated):
        await ApiKeyAuth({}).authenticate("tok-alice")


# -- the Authorization header ---------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer tok-alice", "tok-alice"),
        ("bearer tok-alice", "tok-alice"),  # the scheme is case-insensitive (RFC 9110)
        ("BEARER tok-alice", "tok-alice"),
        ("Bearer  tok-alice  ", "tok-alice"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Bearer    ", None),
        ("Basic dG9rOng=", None),
        ("Bearertok-alice", None),
        ("tok-alice", None),
    ],
)
def test_bearer_token_reads_only_the_bearer_scheme(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


# -- the identity every authenticator answers with -----------------------------------


async def test_api_keys_and_no_auth_identify_without_expiry_or_binding() -> None:
    assert await ApiKeyAuth(KEYS).identify("tok-bob") == Identity(principal="bob")
    assert await NoAuth().identify(None) == Identity(principal=LOCAL_PRINCIPAL)
    identity = await ApiKeyAuth(KEYS).identify("tok-alice")
    assert (identity.expires_at, identity.session_value, identity.claims) == (None, "", {})
    with pytest.raises(Unauthenticated):
        await ApiKeyAuth(KEYS).identify("nope")
