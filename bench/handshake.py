"""Handshake cost: `/ws` connections per second through `auth: jwt` against `auth: none`.

    python bench/handshake.py                     # 8 clients, 3 s per figure, 3 repeats
    python bench/handshake.py --clients 4 --seconds 1 --repeat 1

Three Portico processes on 127.0.0.1: `auth: none`, `auth: jwt`, and `auth: jwt` with its
verified-token cache off (`jwt_cache_entries: 0`); the jwt keys
(an RSA and a P-256 key) this script serves as a JWKS from a thread. Each client loops:
open `/ws` (with `Authorization: Bearer` for jwt), read `connected`, close. Per alg: the
same token without and with the cache (a client reconnecting), and distinct tokens
(`--distinct` pre-minted per repeat, each used once, the run ends when they run out: the
cache cannot help). Figures are interleaved so background noise hits them alike; the
medians and each jwt figure's ratio to `none` are printed. A figure, not a pass/fail:
the target is a ratio of 0.8 or more (keys cached, one verification per handshake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from itertools import repeat
from pathlib import Path

import aiohttp
import jwt
from aiohttp import web
from common import HOST
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from harness import Server, cpu_seconds

AUDIENCE = "portico-bench"


class Keys:
    """The issuer: one RSA and one P-256 key, served as a JWKS on 127.0.0.1."""

    def __init__(self) -> None:
        self.private = {
            "RS256": rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "ES256": ec.generate_private_key(ec.SECP256R1()),
        }
        self.port = 0
        self._ready = threading.Event()

    def jwks(self) -> dict[str, object]:
        keys = []
        for alg, key in self.private.items():
            jwk = json.loads(jwt.get_algorithm_by_name(alg).to_jwk(key.public_key()))
            keys.append({**jwk, "kid": alg, "alg": alg, "use": "sig"})
        return {"keys": keys}

    def token(self, alg: str, jti: str = "") -> str:
        now = int(time.time())
        claims = {
            "jti": jti,
            "iss": self.issuer,
            "aud": AUDIENCE,
            "sub": "bench",
            "iat": now,
            "exp": now + 3600,
        }
        return jwt.encode(claims, self.private[alg], algorithm=alg, headers={"kid": alg})

    @property
    def issuer(self) -> str:
        return f"http://{HOST}:{self.port}"

    def serve(self) -> None:
        threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True).start()
        if not self._ready.wait(10):
            raise RuntimeError("the JWKS server did not start")

    async def _serve(self) -> None:
        app = web.Application()
        document = self.jwks()
        app.router.add_get("/jwks", lambda _: web.json_response(document))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        assert site._server is not None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        await asyncio.Event().wait()


async def handshakes(
    url: str, tokens: Iterator[str | None], clients: int, seconds: float
) -> tuple[int, float]:
    """Connections made and seconds taken: each client opens, reads `connected`, closes.
    Ends at the deadline or when `tokens` runs out (a pool of distinct tokens)."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            token = next(tokens, "")
            if token == "":
                return
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with http.ws_connect(url, headers=headers) as ws:
                first = await ws.receive_json(timeout=10)
                assert first["type"] == "connected", first
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return done, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--distinct", type=int, default=3000, help="distinct tokens minted per alg and repeat"
    )
    args = parser.parse_args()
    keys = Keys()
    keys.serve()
    with tempfile.TemporaryDirectory(prefix="portico-handshake-") as workdir:
        none = Server("portico", Path(workdir), log_level="WARNING").start()
        jwt_env = {
            "PORTICO_AUTH": "jwt",
            "PORTICO_JWT_ISSUER": keys.issuer,
            "PORTICO_JWT_JWKS_URL": keys.issuer + "/jwks",
            "PORTICO_JWT_AUDIENCE": AUDIENCE,
        }
        with_jwt = Server("portico", Path(workdir), log_level="WARNING", env=jwt_env).start()
        uncached_env = {**jwt_env, "PORTICO_JWT_CACHE_ENTRIES": "0"}
        uncached = Server("portico", Path(workdir), log_level="WARNING", env=uncached_env).start()
        # Distinct tokens are minted before the timed runs: signing is client work.
        pools = {
            alg: [
                [keys.token(alg, f"{r}-{i}") for i in range(args.distinct)]
                for r in range(args.repeat)
            ]
            for alg in ("RS256", "ES256")
        }
        cases: dict[str, tuple[Server, Callable[[int], Iterator[str | None]]]] = {
            "none": (none, lambda _: repeat(None)),
        }
        for alg in ("RS256", "ES256"):
            same = keys.token(alg)
            cases[f"jwt {alg} same token, no cache"] = (uncached, lambda _, t=same: repeat(t))
            cases[f"jwt {alg} same token, cached"] = (with_jwt, lambda _, t=same: repeat(t))
            cases[f"jwt {alg} distinct tokens"] = (with_jwt, lambda r, a=alg: iter(pools[a][r]))
        figures: dict[str, list[float]] = {name: [] for name in cases}
        # The server's CPU per handshake: far steadier than throughput on a shared machine.
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        try:
            for round_ in range(args.repeat):
                for name, (server, tokens) in cases.items():
                    before = cpu_seconds(server.pid)
                    done, took = asyncio.run(
                        handshakes(server.url, tokens(round_), args.clients, args.seconds)
                    )
                    figures[name].append(done / took)
                    cpu[name].append((cpu_seconds(server.pid) - before) / done * 1e6)
        finally:
            none.stop()
            with_jwt.stop()
            uncached.stop()
    base = statistics.median(figures["none"])
    base_cpu = statistics.median(cpu["none"])
    print(f"/ws handshakes per second, {args.clients} clients, {args.seconds:g} s x {args.repeat}")
    print("| auth | connections/s (median) | min-max | ratio to none | server CPU µs/handshake |")
    print("|---|---|---|---|---|")
    for name, rates in figures.items():
        median = statistics.median(rates)
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        used = statistics.median(cpu[name])
        print(
            f"| {name} | {median:.0f} | {spread} | {median / base:.2f} "
            f"| {used:.0f} ({base_cpu / used:.2f}) |"
        )


if __name__ == "__main__":
    main()
