// A real OpenID provider for the JWT tests: panva's oidc-provider (OpenID certified),
// on 127.0.0.1:$PORT, issuing JWT access tokens by the client_credentials grant for the
// resource `urn:portico` (audience $AUDIENCE). Each start generates a fresh key set
// (RSA for RS256, P-256 for ES256, new `kid`s): restarting it on the same port is a key
// rotation. Prints "ready <kid>" once it listens.
import { generateKeyPairSync, randomUUID } from "node:crypto";
import Provider from "oidc-provider";

const port = Number(process.env.PORT);
const alg = process.env.ALG || "RS256";
const audience = process.env.AUDIENCE || "portico-tests";
const issuer = `http://127.0.0.1:${port}`;

function signingKey(alg) {
  const pair = alg === "ES256"
    ? generateKeyPairSync("ec", { namedCurve: "P-256" })
    : generateKeyPairSync("rsa", { modulusLength: 2048 });
  const jwk = pair.privateKey.export({ format: "jwk" });
  return { ...jwk, kid: `${alg}-${randomUUID()}`, alg, use: "sig" };
}

const key = signingKey(alg);
const provider = new Provider(issuer, {
  clients: [
    {
      client_id: "portico-test",
      client_secret: "portico-test-secret",
      grant_types: ["client_credentials"],
      response_types: [],
      redirect_uris: [],
      id_token_signed_response_alg: alg, // the only key there is signs everything
    },
  ],
  jwks: { keys: [key] },
  cookies: { keys: [randomUUID()] },
  features: {
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => "urn:portico",
      getResourceServerInfo: () => ({
        scope: "chat",
        audience,
        accessTokenTTL: 300,
        accessTokenFormat: "jwt",
        jwt: { sign: { alg } },
      }),
    },
  },
});

const server = provider.listen(port, "127.0.0.1", () => {
  console.log(`ready ${key.kid}`);
});
process.on("SIGTERM", () => server.close(() => process.exit(0)));
