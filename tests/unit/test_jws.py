"""The strict compact-JWS reader and claim rules (`auth/jws.py`) against PyJWT's own.

The reader replaces `jwt.decode`'s parsing for speed, so the strongest check is a
differential one: for tokens mutated at random (hypothesis), `jwt.decode` and this module
accept exactly the same ones. The named cases are the rules where the two differ on
purpose (a time claim given as a string) or where a second spelling of a signature would
otherwise pass.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.auth.jws import ClaimRules, check_claims, parse_compact, verify_signature
from portico.errors import Unauthenticated

RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC = ec.generate_private_key(ec.SECP256R1())
ISSUER, AUDIENCE, LEEWAY = "https://issuer.test", "portico", 30.0
RULES = ClaimRules(ISSUER, AUDIENCE, LEEWAY)
NOW = 1_800_000_000.0


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**overrides: Any) -> dict[str, Any]:
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "ann", "iat": NOW, "exp": NOW + 600}
    return {k: v for k, v in {**base, **overrides}.items() if v is not None}


def token(alg: str = "RS256", **overrides: Any) -> str:
    key = RSA if alg.startswith("RS") else EC
    return jwt.encode(claims(**overrides), key, algorithm=alg)


def ours(credential: str, alg: str = "RS256", now: float = NOW) -> dict[str, Any]:
    parsed = parse_compact(credential)
    if parsed.header.get("alg") != alg:
        raise Unauthenticated("token algorithm not allowed")
    public = (RSA if alg.startswith("RS") else EC).public_key()
    verify_signature(parsed, alg, public)
    check_claims(parsed.claims, RULES, now)
    return parsed.claims


def pyjwts(credential: str, alg: str = "RS256") -> dict[str, Any]:
    public = (RSA if alg.startswith("RS") else EC).public_key()
    # PyJWT reads its own wall clock: run it on tokens whose times are relative to now.
    result: dict[str, Any] = jwt.decode(
        credential,
        public,
        algorithms=[alg],
        audience=AUDIENCE,
        issuer=ISSUER,
        leeway=LEEWAY,
        options={"require": ["exp"]},
    )
    return result


def refusal(credential: str, **kwargs: Any) -> str:
    with pytest.raises(Unauthenticated) as exc:
        ours(credential, **kwargs)
    return exc.value.message


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_a_valid_token_reads_as_its_claims(alg: str) -> None:
    assert ours(token(alg), alg)["sub"] == "ann"


def test_an_audience_list_naming_portico_is_accepted() -> None:
    assert ours(token(aud=["other", AUDIENCE]))["sub"] == "ann"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"exp": NOW - LEEWAY}, "token expired"),
        ({"exp": None}, "token lacks a required claim"),
        ({"nbf": NOW + LEEWAY + 1}, "token not yet valid"),
        ({"iat": NOW + LEEWAY + 1}, "token not yet valid"),
        ({"iss": "https://elsewhere.test"}, "token issuer not accepted"),
        ({"iss": None}, "token lacks a required claim"),
        ({"aud": "someone-else"}, "token audience not accepted"),
        ({"aud": ["a", 1]}, "token audience not accepted"),
        ({"aud": None}, "token lacks a required claim"),
        ({"exp": str(int(NOW + 600))}, "invalid token"),  # PyJWT takes it; RFC 7519 does not
        ({"exp": True}, "invalid token"),
        ({"exp": 10**400}, "invalid token"),
        ({"sub": 7}, "invalid token"),
        ({"jti": ["x"]}, "invalid token"),
    ],
)
def test_each_claim_rule(overrides: dict[str, Any], reason: str) -> None:
    assert refusal(token(**overrides)) == reason


def test_nan_and_infinity_are_not_times() -> None:
    header, _, _ = token().split(".")
    for literal in ("NaN", "Infinity"):
        body = f'{{"iss":"{ISSUER}","aud":"{AUDIENCE}","exp":{literal}}}'.encode()
        parsed = parse_compact(f"{header}.{b64(body)}.AAAA")  # json.loads takes both
        with pytest.raises(Unauthenticated, match="invalid token"):
            check_claims(parsed.claims, RULES, NOW)


def test_the_leeway_admits_skew_and_no_more() -> None:
    assert ours(token(exp=NOW - LEEWAY + 1))["sub"] == "ann"
    assert ours(token(nbf=NOW + LEEWAY))["sub"] == "ann"


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t + "=",  # padding
        lambda t: t + "!!!!",  # junk after the signature (GHSA-hxm8-2xgr-2p9m)
        lambda t: t.replace(".", "..", 1),
        lambda t: t + ".x",  # four segments
        lambda t: t.rsplit(".", 1)[0],  # two
        lambda t: " " + t,
        lambda t: t.replace("-", "+").replace("_", "/") if ("-" in t or "_" in t) else t + "+",
    ],
)
def test_anything_but_a_strict_compact_serialisation_is_invalid(mangle: Any) -> None:
    assert refusal(mangle(token())) == "invalid token"


def test_a_second_spelling_of_the_signature_is_refused() -> None:
    head, body, signature = token().split(".")
    raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
    assert len(raw) % 3 != 0  # a 256-byte signature leaves unused bits in its last char
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    sibling = alphabet[alphabet.index(signature[-1]) | 1]  # same bytes, a low bit set
    assert sibling != signature[-1]
    assert base64.urlsafe_b64decode(signature[:-1] + sibling + "==") == raw
    assert refusal(f"{head}.{body}.{signature[:-1]}{sibling}") == "invalid token"


@pytest.mark.parametrize(
    "header",
    [{"alg": "RS256", "crit": ["exp"]}, {"alg": "RS256", "b64": False, "crit": ["b64"]}],
)
def test_extensions_are_refused(header: dict[str, Any]) -> None:
    credential = jwt.encode(claims(), RSA, algorithm="RS256", headers=header)
    assert refusal(credential) == "invalid token"


def test_headers_and_claims_must_be_json_objects() -> None:
    head, body, signature = token().split(".")
    assert refusal(f"{b64(b'[1]')}.{body}.{signature}") == "invalid token"
    assert refusal(f"{head}.{b64(b'not json')}.{signature}") == "invalid token"


def test_a_key_of_another_type_never_verifies() -> None:
    parsed = parse_compact(jwt.encode(claims(), "secret-secret-secret-secret-32b!", "HS256"))
    with pytest.raises(Unauthenticated, match="does not match its key"):
        verify_signature(parsed, "HS256", RSA.public_key())


def test_a_tampered_claim_fails_the_signature() -> None:
    head, _, signature = token().split(".")
    forged = b64(json.dumps(claims(sub="mallory")).encode())
    assert refusal(f"{head}.{forged}.{signature}") == "token signature invalid"


# -- the same verdicts as jwt.decode ------------------------------------------------------

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=!+/ "


def verdict(check: Any, credential: str) -> bool:
    try:
        check(credential)
    except (Unauthenticated, jwt.PyJWTError):
        return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    position=st.integers(min_value=0),
    replacement=st.sampled_from(ALPHABET),
    cut=st.booleans(),
)
def test_mutated_tokens_get_pyjwts_verdict(position: int, replacement: str, cut: bool) -> None:
    now = time.time()
    original = jwt.encode(
        claims(iat=int(now), exp=int(now) + 600), RSA, algorithm="RS256", headers={"kid": "k"}
    )
    at = position % len(original)
    mutated = original[:at] + ("" if cut else replacement) + original[at + 1 :]
    assert verdict(lambda c: ours(c, now=time.time()), mutated) == verdict(pyjwts, mutated)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_any_text_is_a_token_or_invalid(text: str) -> None:
    try:
        parse_compact(text)
    except Unauthenticated as exc:
        refused = exc.message
    else:
        refused = "invalid token"  # parsed: the signature and claims decide
    assert refused == "invalid token"
