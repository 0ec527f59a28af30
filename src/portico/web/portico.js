/**
 * portico.js: the reference browser client for Portico (an ES module, no dependencies).
 *
 * Copy this file into your app, or import it from a Portico server (`/web/portico.js`).
 * It mirrors the Python SDK (`portico.client`) for browsers:
 *
 *   SessionClient  GET /v1/session  one resumable conversation: exactly-once delivery
 *                  both ways across reconnects (seq/ack, resend, duplicate discard),
 *                  heartbeats, backoff with jitter, client-side tools with consent.
 *   RpcClient      GET /v1/rpc      all of a user's conversations: the 17 methods, the
 *                  ordered update stream with offset recovery, live chunks.
 *   uploadFile     POST /media/request-upload, then PUT: a file as a message part.
 *   fetchMedia     GET /media/download/...: stored media as a Blob (owner only).
 *   VoiceCall      GET /ws?binary=true  a voice call (docs/voice.md): binary OMNI frames
 *                  up, agent audio, transcripts, barge-in, hangup, `?resume` after a drop.
 *   VoiceConversation  a VoiceCall with the microphone (`Microphone`, an AudioWorklet in
 *                  `voice-worklet.js`) and the speaker (`VoicePlayer`, Web Audio).
 *
 * SessionClient, as Python's `SessionClient` (docs/session.md, spec sessions-protocol.md):
 *
 *   const client = new SessionClient("/v1/session", { credential: token });
 *   client.registerTool("get_time", () => new Date().toISOString(), {
 *     description: "the local time",
 *     consent: async (frame) => confirm(frame.tool_call.consent_message ?? "Allow?"),
 *   });                                          // register before connecting
 *   client.addEventListener("message", (e) => console.log(e.detail)); // every numbered frame
 *   client.addEventListener("status", (e) => console.log(e.detail));  // open/dropped/closed
 *   await client.connect();                      // hello -> ready
 *   const reply = await client.ask("hello");     // a Turn's frames up to done or error
 *   console.log(reply.text);
 *
 * - Every numbered server message is dispatched once, in order, as a `message` event, across
 *   reconnects; the frames answering a message sent with `startTurn()`/`ask()` also go to
 *   that `Turn` (a new turn answers the oldest message still waiting for one; a refusal
 *   names its message in `ref_seq`).
 * - Sent messages are kept until the server acknowledges them and resent after a resume;
 *   received ones are acknowledged within `ackDelay` s or after `ackEvery` messages, and
 *   duplicates are discarded. The client pings every heartbeat interval (the shorter of
 *   `heartbeatInterval` and the server's `ready.heartbeat_ms`) and drops a link silent for `deadAfter`
 *   intervals; reconnects back off exponentially with jitter (`ReconnectPolicy`) and start
 *   at once when the browser reports it is back online.
 * - A registered tool is acknowledged, put to its `consent` callback, run, and answered
 *   (a refused consent is a nack "declined by the user"). The `tool_call` frame is still
 *   dispatched. Unregistered tools are yours: `ackToolCall`, `sendToolResult`, `nackToolCall`.
 *   `handleToolCall(info)` runs the registered flow for a call learned elsewhere (the archive
 *   after a page reload: the frame was handled by the page before it reloaded).
 * - Short-lived tokens: with `credentialProvider`, a JWT is replaced before its `exp` by an
 *   unnumbered `credential` frame with the callback's answer, so the server never closes
 *   the connection 4401 "credential expired"; after a 4401 anyway the client resumes with a
 *   fresh token and loses nothing (docs/auth.md, Expiry and refresh). `RpcClient` does the
 *   same with `tokenProvider`.
 * - Terminal: `ResumeFailedError` (4404: the session is gone; messages are never replayed
 *   into a new one), `AuthenticationError` (4401 without a `credentialProvider`, or twice),
 *   `SessionReplacedError` (4409), `ConnectionLostError` (no connection for
 *   `reconnect.giveUpAfter` s), `ProtocolError` (4400/1009 three times in a row). They reject
 *   `connect()` and pending turns, and arrive as `status` {state: "closed", error}.
 * - Audio: pass `audioOutput: [{codec: "wav"}, ...]` (formats you accept, preferred first) to
 *   ask for the `audio` capability. The agent's streamed media (audio, or images) then arrive
 *   as items: a numbered `audio_start`, binary OMNI frames (never numbered or resent), an
 *   `audio_end`. Just before an item's `audio_end` is dispatched, a `media` event carries
 *   {item_id, turn_id, format, blob, complete}: `blob` has the item's bytes and
 *   `format.mime_type`; `complete` is false for an item cut by a dropped connection.
 * - Browser additions: `snapshot()` is the session's resumable state (session id, both
 *   sequence positions, unacknowledged messages) and `onState` is called whenever it
 *   changes; pass a snapshot as `resumeFrom` to a new client (after a page reload, say) and
 *   it resumes that session instead of opening one. Browsers cannot send a WebSocket
 *   close code 1001, so `close()` closes with 1000; the server keeps the session either way.
 * - Continuing after a server restart, as Python's: `continueAfterRestart: true` turns a
 *   failed resume into `hello.continue` (a new numbering on the same conversation; the
 *   `status` event says `continued: true`), `continueSession: id` opens that way.
 * - Idempotency keys (docs/session.md): every message carries `client_id` (`clientId` in
 *   `startTurn`/`sendMessage`, a fresh `newMessageKey()` otherwise; `turn.clientId`), kept
 *   in the frame across resends, snapshots and continuations. Send a message again with its
 *   key and the server never takes it twice: the answer is an `error` DUPLICATE_MESSAGE
 *   (`reply.duplicate` has its details, `reply.text` the earlier answer's archived text);
 *   while the earlier turn still runs, its frames follow instead.
 *
 * RpcClient, as Python's `RpcClient` (docs/rpc.md, spec rpc-protocol.md):
 *
 *   const rpc = new RpcClient("/v1/rpc", { token, offset: saved?.offset, epoch: saved?.epoch });
 *   rpc.addEventListener("update", (e) => apply(e.detail));   // each once, in offset order
 *   rpc.addEventListener("reset", () => reloadWithQueries()); // continuity was lost
 *   rpc.addEventListener("live", (e) => appendDelta(e.detail));
 *   await rpc.connect();
 *   const page = await rpc.sessionList({ limit: 20 });
 *   // persist rpc.offset and rpc.epoch with the state the updates built
 *
 * - Updates are dispatched in offset order, each once across reconnects (repeats dropped by
 *   offset, gaps skipped). After a drop the client reconnects with the offset and epoch of
 *   the last update it dispatched and the server replays what was missed. `reset` means the
 *   server could not (another epoch, offset no longer retained): reload with queries. The
 *   first connect without a stored position is not a reset: load state with queries then.
 * - Live chunks are best effort; the final content arrives as the message's update.
 * - A request whose connection drops before its reply is sent again only when a repeat
 *   cannot take effect twice (queries, `message.send` deduplicated by `client_id`,
 *   `session.close/open/update`, `rtc.submit_result`, `rtc.update_status`); otherwise it
 *   rejects with `RpcConnectionLostError` (outcome unknown). Never repeated:
 *   `session.fork`, `session.compact`, `turn.stop`.
 * - Browsers cannot send WebSocket pings, so after `heartbeatInterval` s of silence the
 *   client sends Portico's `{"type": "ping"}` frame (answered with `pong`), and drops a
 *   link that stays silent for `deadAfter` intervals.
 * - Errors: `RpcCallError` (`code`, `message`, `details`) for an error reply;
 *   `RpcAuthenticationError` (terminal), `RpcConnectError` (first connect failed),
 *   `RpcConnectionLostError`, `RpcTimeoutError` (`requestTimeout`).
 */

export const PROTOCOL_VERSION = 1;
export const DECLINED_BY_USER = "declined by the user";
const MiB = 1024 * 1024;
const CLOSE_NORMAL = 1000;
const CLOSE_TOO_LARGE = 1009;
const CLOSE_ABNORMAL = 1006; // the browser's code for "no close frame": an abrupt drop
const CLOSE_PROTOCOL_ERROR = 4400;
const CLOSE_UNAUTHENTICATED = 4401;
const CLOSE_RESUME_FAILED = 4404;
const CLOSE_REPLACED = 4409;
// Closes that blame this client: resuming resends the same frames, so a few in a row
// without a working connection in between is a client bug.
const CLIENT_FAULT_CLOSES = new Set([CLOSE_TOO_LARGE, CLOSE_PROTOCOL_ERROR]);
const MAX_CLIENT_FAULTS = 3;

const now = () => performance.now() / 1000;
const encoder = new TextEncoder();
const byteLength = (text) => encoder.encode(text).length;

/** `/v1/session` -> `ws://host/v1/session` (or wss: on an https page). */
export function websocketUrl(path) {
  const url = new URL(path, location.href);
  if (url.protocol === "http:") url.protocol = "ws:";
  if (url.protocol === "https:") url.protocol = "wss:";
  return url.toString();
}

/** The `Sec-WebSocket-Protocol` prefix that carries a token on a browser's `/ws` upgrade. */
export const BEARER_SUBPROTOCOL_PREFIX = "portico.bearer.";

/**
 * Open `/ws` (the Omnia protocol) from a browser, authenticated: a browser cannot set
 * `Authorization` on a WebSocket upgrade, and a token in the URL would be logged, so the
 * token goes as a subprotocol entry next to a real one (`protocol`), which the server
 * selects; the token is never echoed. Without a token, nothing is offered.
 * The token must be made of HTTP token characters (a JWT or a base64url API key is).
 *
 *   const ws = openOmniaSocket("/ws?agent=default", { token, credentialProvider: getToken });
 *
 * With `credentialProvider` (() => token or Promise<token>), a JWT is replaced before its
 * `exp` by a `credential_refresh` frame with the callback's answer (no reply comes), so
 * the server does not close the socket 4401 "credential expired"; after a 4401 anyway,
 * open a new socket with a fresh token and resume with its `session_id`.
 */
export function openOmniaSocket(
  path,
  { token = null, protocol = "omnia", credentialProvider = null } = {},
) {
  const protocols = token ? [BEARER_SUBPROTOCOL_PREFIX + token, protocol] : [];
  const ws = new WebSocket(websocketUrl(path), protocols);
  if (token && credentialProvider) {
    const stop = keepCredentialFresh(token, credentialProvider, (fresh) => {
      if (ws.readyState === WebSocket.OPEN) {
        ws.send(JSON.stringify({ type: "credential_refresh", token: fresh }));
      }
    });
    ws.addEventListener("close", stop);
  }
  return ws;
}

// -- short-lived tokens (docs/auth.md, Expiry and refresh) --------------------------------

// The server closes a connection 4401 "credential expired" 30 s before its token's `exp`
// (half its remaining life when that is shorter). Given a token callback, the clients
// ask it again before then and send the answer on the open connection.
const REFRESH_LEAD = 60; // seconds before `exp`...
const REFRESH_FRACTION = 0.4; // ...or this fraction of the remaining life, the later

/** A JWT's `exp` (Unix seconds), read without verifying (the server verifies); or null. */
export function tokenExpiry(token) {
  const parts = typeof token === "string" ? token.split(".") : [];
  if (parts.length !== 3) return null;
  try {
    const base64 = parts[1].replace(/-/g, "+").replace(/_/g, "/");
    const claims = JSON.parse(atob(base64 + "=".repeat((4 - (base64.length % 4)) % 4)));
    return typeof claims?.exp === "number" ? claims.exp : null;
  } catch {
    return null;
  }
}

/** Seconds from now until a token expiring at `expiresAt` should be replaced. */
export function refreshDelay(expiresAt, nowSeconds = Date.now() / 1000) {
  const remaining = expiresAt - nowSeconds;
  return Math.max(0, remaining - REFRESH_LEAD, remaining * REFRESH_FRACTION);
}

/**
 * Until `stop()` is called: before `token` nears its `exp`, ask `provider` and pass the
 * answer to `send`. Stops by itself when a token has no `exp` or the callback has nothing
 * later (the 4401 and the reconnect with a fresh token then take over). Returns `stop`.
 */
export function keepCredentialFresh(token, provider, send) {
  let timer = null;
  let stopped = false;
  const schedule = (current) => {
    const expiresAt = tokenExpiry(current);
    if (stopped || expiresAt == null) return;
    timer = setTimeout(async () => {
      let fresh;
      try {
        fresh = await provider();
      } catch (error) {
        console.warn("credential callback failed", describe(error));
        return;
      }
      const freshExpiry = tokenExpiry(fresh);
      if (stopped || freshExpiry == null || freshExpiry <= expiresAt) return;
      send(fresh);
      schedule(fresh);
    }, refreshDelay(expiresAt) * 1000);
  };
  schedule(token);
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function deferred() {
  let resolve, reject;
  const promise = new Promise((res, rej) => {
    resolve = res;
    reject = rej;
  });
  promise.catch(() => {}); // a rejection nobody awaits is not an error here
  return { promise, resolve, reject };
}

// -- errors -------------------------------------------------------------------------------

/** The session cannot go on. `code` and `closeCode` are the server's, when it sent them. */
export class SessionError extends Error {
  constructor(message, { code = null, closeCode = null, details = null } = {}) {
    super(message);
    this.name = this.constructor.name;
    this.code = code;
    this.closeCode = closeCode;
    this.details = details ?? {};
  }
}
/** The first connection failed: nothing was opened. */
export class ConnectError extends SessionError {}
/** RESUME_FAILED (4404): the session is gone; open a new client for a new session. */
export class ResumeFailedError extends SessionError {}
/** UNAUTHENTICATED (4401) and no `credentialProvider` to get a new credential. */
export class AuthenticationError extends SessionError {}
/** 4409: a newer connection resumed this session; this client stops. */
export class SessionReplacedError extends SessionError {}
/** No connection could be made for `ReconnectPolicy.giveUpAfter` seconds. */
export class ConnectionLostError extends SessionError {}
/** The server closed with 4400 or 1009 again and again: this client sends bad frames. */
export class ProtocolError extends SessionError {}
/** The client was closed, or the session ended, before the operation could happen. */
export class SessionClosedError extends SessionError {}
/** The resend buffer is full (the server has not acknowledged); nothing was sent. */
export class SendBufferFullError extends SessionError {}

// -- reconnects ---------------------------------------------------------------------------

/** Exponential backoff with jitter between reconnection attempts (seconds). */
export class ReconnectPolicy {
  constructor({ initial = 0.25, maximum = 8, factor = 2, jitter = 0.5, giveUpAfter = 120 } = {}) {
    Object.assign(this, { initial, maximum, factor, jitter, giveUpAfter });
  }

  /** Seconds to wait before retry number `attempt` (0 for the first). */
  delay(attempt, random = Math.random) {
    const base = Math.min(this.maximum, this.initial * this.factor ** attempt);
    // Jitter spreads the reconnects of many clients a server dropped at once.
    return base * (1 - this.jitter * random());
  }
}

/**
 * When to try again: backoff since the last connection that worked, and the clock that
 * gives up (`giveUpAfter`) with the client's own error type.
 */
class Retries {
  constructor(policy, LostError) {
    this.policy = policy;
    this.LostError = LostError;
    this.connected();
  }

  connected() {
    this.attempt = 0; // failed attempts since the last connection that worked
    this.lostSince = null;
  }

  /** Seconds to wait before the next attempt; throws `LostError` past the limit. */
  nextDelay() {
    this.lostSince ??= now();
    const lostFor = now() - this.lostSince;
    const giveUp = this.policy.giveUpAfter;
    if (giveUp != null && lostFor >= giveUp) {
      throw new this.LostError(`no connection for ${Math.round(lostFor)} s; giving up`);
    }
    return this.policy.delay(this.attempt++);
  }
}

/** Sleep `seconds`, or less when `wake` fires (online again, closing). */
function backoff(seconds, wake) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      wake.delete(done);
      resolve();
    };
    const timer = setTimeout(done, seconds * 1000);
    wake.add(done);
  });
}

function watchOnline(wake) {
  const handler = () => [...wake].forEach((fn) => fn());
  globalThis.addEventListener?.("online", handler);
  return () => globalThis.removeEventListener?.("online", handler);
}

// -- one turn -----------------------------------------------------------------------------

const endsTurn = (frame) =>
  frame.type === "done" || (frame.type === "error" && frame.turn_id != null);

export const DUPLICATE_MESSAGE = "DUPLICATE_MESSAGE";

/** A fresh idempotency key (`message.client_id`) for one message. */
export const newMessageKey = () => `cm-${crypto.randomUUID()}`;

/** The running turn that already answers a message sent again with its key, or null. */
const runningDuplicate = (frame) =>
  frame.type === "error" &&
  frame.turn_id == null &&
  frame.error?.code === DUPLICATE_MESSAGE &&
  frame.error.details?.turn_state === "running"
    ? frame.error.details.turn_id ?? null
    : null;

/** One turn's frames: `done` or `error` last. */
export class Reply {
  constructor(turnId, frames) {
    this.turnId = turnId;
    this.frames = frames;
  }
  get done() {
    const last = this.frames.at(-1);
    return last?.type === "done" ? last : null;
  }
  get error() {
    const last = this.frames.at(-1);
    return last?.type === "error" ? last.error : null;
  }
  /** DUPLICATE_MESSAGE details: the server already had this message (its key). */
  get duplicate() {
    return this.error?.code === DUPLICATE_MESSAGE ? this.error.details ?? {} : null;
  }
  /** `done.content` when the server sent one, else the chunks (for a message the server
   * already had, the earlier answer's archived text). */
  get text() {
    if (this.done?.content != null) return this.done.content;
    if (this.duplicate) return this.duplicate.reply ?? "";
    return this.frames
      .filter((f) => f.type === "chunk")
      .map((f) => f.content)
      .join("");
  }
  get cancelled() {
    return Boolean(this.done?.cancelled);
  }
  get toolCalls() {
    return this.frames.filter((f) => f.type === "tool_call").map((f) => f.tool_call);
  }
}

/**
 * The frames answering one message, in order, ending with its `done` or `error`:
 * `for await (const frame of turn)` or `await turn.reply()`. A refused message
 * (TURN_IN_PROGRESS, INVALID_MESSAGE, ...) gives one `error` frame with `ref_seq`.
 */
export class Turn {
  constructor(messageSeq, clientId = null) {
    this.messageSeq = messageSeq;
    this.clientId = clientId; // the message's key: send it again with this one
    this.turnId = null;
    this.frames = [];
    this._ended = false;
    this._failure = null;
    this._wake = [];
    this._finished = deferred();
  }

  _put(frame) {
    this.frames.push(frame);
    const refused =
      frame.type === "error" && frame.ref_seq === this.messageSeq && !runningDuplicate(frame);
    if (endsTurn(frame) || refused) {
      this._ended = true;
      this._finished.resolve(new Reply(this.turnId, [...this.frames]));
    }
    this._wake.splice(0).forEach((fn) => fn());
  }

  _stop(error) {
    if (this._ended) return;
    this._failure = error;
    this._finished.reject(error);
    this._wake.splice(0).forEach((fn) => fn());
  }

  /** The whole turn, once it ended. */
  reply() {
    return this._finished.promise;
  }

  async *[Symbol.asyncIterator]() {
    let index = 0;
    for (;;) {
      if (index < this.frames.length) {
        yield this.frames[index++];
      } else if (this._ended) {
        return;
      } else if (this._failure) {
        throw this._failure;
      } else {
        await new Promise((resolve) => this._wake.push(resolve));
      }
    }
  }
}

// -- binary frames ----------------------------------------------------------------------------

const OMNI_HEADER = 32; // bytes: the Omnia binary frame header (docs/session.md)
const utf8 = new TextDecoder("utf-8", { fatal: true });

/** Decode one OMNI frame: {mediaId, sequence, isLast, metadata, payload}; throws if malformed. */
export function decodeOmni(buffer) {
  if (buffer.byteLength < OMNI_HEADER) throw new ProtocolError("invalid header size");
  const view = new DataView(buffer);
  const magic = String.fromCharCode(...new Uint8Array(buffer, 0, 4));
  if (magic !== "OMNI") throw new ProtocolError("invalid magic bytes");
  if (view.getUint8(4) !== 1) throw new ProtocolError("unsupported binary protocol version");
  const flags = view.getUint8(5);
  const metadataLen = view.getUint32(8);
  const payloadLen = view.getUint32(12);
  if (OMNI_HEADER + metadataLen + payloadLen !== buffer.byteLength) {
    throw new ProtocolError("frame length does not match header");
  }
  if (view.getUint16(6) !== 1) throw new ProtocolError("unknown binary message type");
  const id = new Uint8Array(buffer, 20, 12);
  let end = id.length;
  while (end > 0 && id[end - 1] === 0) end -= 1;
  let metadata;
  try {
    metadata = JSON.parse(utf8.decode(new Uint8Array(buffer, OMNI_HEADER, metadataLen)));
  } catch {
    throw new ProtocolError("invalid metadata");
  }
  return {
    mediaId: utf8.decode(id.subarray(0, end)),
    sequence: view.getUint32(16),
    isLast: Boolean(flags & 0x04),
    metadata,
    payload: new Uint8Array(buffer, OMNI_HEADER + metadataLen, payloadLen),
  };
}

// -- one /v1/session connection --------------------------------------------------------------

class SessionLink {
  constructor(client, ws, hello) {
    this.client = client;
    this.ws = ws;
    this.continuing = hello.continue ?? null; // a new numbering on this archived session
    this.state = "connecting"; // connecting -> await_ready -> open -> closed
    this.closeCode = null;
    this.error = null; // the connection-level error frame explaining the close
    this.ready = deferred();
    this.closed = deferred();
    this.heartbeat = client._heartbeatInterval;
    this.lastReceived = now();
    this.nextPing = Infinity;
    this.unacked = 0;
    this.ackDeadline = null;
    this.timer = null;
    ws.onopen = () => {
      this.state = "await_ready";
      this.lastReceived = now();
      this._write(hello);
      this._schedule();
    };
    ws.binaryType = "arraybuffer"; // media frames: decoded synchronously, in order
    ws.onmessage = (event) =>
      event.data instanceof ArrayBuffer
        ? this._receiveBinary(event.data)
        : this._receive(event.data);
    ws.onclose = (event) => this._finish(event.code === CLOSE_ABNORMAL ? null : event.code);
    ws.onerror = () => {}; // a close event follows
  }

  _write(frame) {
    const data = typeof frame === "string" ? frame : JSON.stringify(frame);
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(data);
  }

  /** A numbered message the client just numbered: live now if the handshake is done. */
  writeNumbered(data) {
    if (this.state === "open") this._write(data);
  }

  _receive(data) {
    this.lastReceived = now();
    if (this.state === "closed") return;
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      return this.fail("malformed frame from the server");
    }
    if (typeof frame !== "object" || frame === null || typeof frame.type !== "string") {
      return this.fail("a frame without a type");
    }
    try {
      this._dispatch(frame);
    } catch (error) {
      if (error instanceof ProtocolError) return this.fail(error.message);
      throw error;
    }
    this._schedule();
  }

  /** A binary frame: a chunk of a media item (the `audio` capability). */
  _receiveBinary(data) {
    this.lastReceived = now(); // any frame counts as liveness
    if (this.state !== "open") return;
    if (!this.client.capabilities.includes("audio")) {
      return this.fail("binary frames need the audio capability");
    }
    let chunk;
    try {
      chunk = decodeOmni(data);
    } catch (error) {
      return this.fail(error.message);
    }
    this.client._mediaChunk(chunk);
  }

  _dispatch(frame) {
    const client = this.client;
    if (this.state === "await_ready") {
      if (frame.type === "error" && frame.seq == null) {
        this.error = frame.error;
        return;
      }
      if (frame.type !== "ready") throw new ProtocolError("the first frame must be ready");
      if (this.continuing != null && (frame.resumed || frame.session_id !== this.continuing)) {
        throw new ProtocolError("a continued conversation must keep its id, not resume");
      }
      client._acknowledge(frame.last_seq);
      this.state = "open";
      // The shorter of ours and the server's: its idle timeout is sized for what it announces.
      if (frame.heartbeat_ms > 0) {
        this.heartbeat = Math.min(this.client._heartbeatInterval, frame.heartbeat_ms / 1000);
      }
      this.nextPing = now() + this.heartbeat;
      for (const entry of client._buffer) this._write(entry.data); // the resend backlog
      client._wireSeq = client._nextSeq - 1;
      this.ready.resolve(frame);
      return;
    }
    switch (frame.type) {
      case "ack":
        client._acknowledge(frame.seq);
        return;
      case "ping":
        this._write({ type: "pong" });
        return;
      case "pong":
        return;
      case "ready":
        throw new ProtocolError("ready was already received on this connection");
      case "error":
        if (frame.seq == null) {
          this.error = frame.error; // explains the close that follows
          return;
        }
    }
    if (!Number.isInteger(frame.seq) || frame.seq < 1) {
      throw new ProtocolError(`${frame.type} needs a seq of 1 or more`);
    }
    const fresh = client._receiveSeq(frame.seq);
    this._scheduleAck();
    if (fresh) client._deliver(frame);
  }

  _scheduleAck() {
    this.unacked += 1;
    if (this.unacked >= this.client._ackEvery) this._sendAck();
    else if (this.ackDeadline == null) this.ackDeadline = now() + this.client._ackDelay;
  }

  _sendAck() {
    this._write({ type: "ack", seq: this.client._handled });
    this.unacked = 0;
    this.ackDeadline = null;
  }

  _schedule() {
    clearTimeout(this.timer);
    if (this.state === "closed") return;
    let next = this.lastReceived + this.heartbeat * this.client._deadAfter;
    if (this.ackDeadline != null) next = Math.min(next, this.ackDeadline);
    if (this.state === "open") next = Math.min(next, this.nextPing);
    this.timer = setTimeout(() => this._onTimer(), Math.max(0, (next - now()) * 1000));
  }

  _onTimer() {
    if (this.state === "closed") return;
    const t = now();
    if (this.ackDeadline != null && t >= this.ackDeadline) this._sendAck();
    if (t - this.lastReceived >= this.heartbeat * this.client._deadAfter) {
      return this.abort("the server was silent for too long");
    }
    if (this.state === "open" && t >= this.nextPing) {
      this._write({ type: "ping" });
      this.nextPing = t + this.heartbeat;
    }
    this._schedule();
  }

  /** A protocol violation by the server: say so, close 4400, and resume. */
  fail(message) {
    this._write({ type: "error", error: { code: "PROTOCOL_ERROR", message } });
    this.close(CLOSE_PROTOCOL_ERROR, "protocol error");
  }

  close(code, reason) {
    if (this.state === "closed") return;
    this.state = "closed";
    clearTimeout(this.timer);
    try {
      this.ws.close(code, reason);
    } catch {
      this.ws.close();
    }
  }

  /** Give up on the socket at once, as a network failure would: no waiting for its close. */
  abort(reason) {
    if (this.state !== "closed") this.close(CLOSE_NORMAL, reason);
    this._finish(null);
  }

  /** Send a fresh token (`credential`, unnumbered) before this one's deadline. */
  keepCredentialFresh(credential, provider) {
    this.stopRefresh = keepCredentialFresh(credential, provider, (fresh) => {
      if (this.state === "open") this._write({ type: "credential", credential: fresh });
    });
  }

  _finish(code) {
    clearTimeout(this.timer);
    this.stopRefresh?.();
    this.state = "closed";
    this.ws.onopen = this.ws.onmessage = this.ws.onclose = null;
    if (this.closeCode == null) this.closeCode = code;
    this.ready.reject(new SessionError("closed before ready"));
    this.closed.resolve();
  }
}

// -- the session client ---------------------------------------------------------------------

/** A resumable session over `GET /v1/session`; see the top of this file. */
export class SessionClient extends EventTarget {
  constructor(
    url,
    {
      credential = null,
      credentialProvider = null, // () => token or Promise<token>, asked before every connection
      agent = null,
      tools = [], // specs {name, description, parameters} answered by the application
      context = null,
      capabilities = ["tools", "context"],
      audioOutput = null, // formats [{codec, sample_rate, channels, mime_type}]: ask for audio
      reconnect = new ReconnectPolicy(),
      heartbeatInterval = 15, // seconds between pings, until `ready` announces the server's
      deadAfter = 2.5, // heartbeat intervals of silence before a link is dead
      ackDelay = 0.1, // seconds: acknowledge within this long...
      ackEvery = 16, // ...or after this many unacknowledged messages
      maxBufferMessages = 1000, // resend buffer: messages...
      maxBufferBytes = 8 * MiB, // ...and bytes not yet acknowledged
      connectTimeout = 10, // seconds for the upgrade plus hello/ready
      closeTimeout = 5, // seconds `end()` waits for the server's close
      resumeFrom = null, // a `snapshot()`: resume that session instead of opening one
      onState = null, // called with `snapshot()` whenever it changes
      continueSession = null, // open by continuing this archived session (`hello.continue`)
      continueAfterRestart = false, // on RESUME_FAILED, continue the conversation instead
    } = {},
  ) {
    super();
    this.url = websocketUrl(url);
    this.sessionId = null;
    this.capabilities = [];
    this.ready = null; // the latest `ready`
    this.connections = 0; // how many connections reached `ready`
    this._credential = credential;
    this._credentialProvider = credentialProvider;
    this._agent = agent;
    this._toolSpecs = tools.map((t) => ({
      name: t.name,
      description: t.description ?? "",
      parameters: t.parameters ?? {},
    }));
    this._context = context;
    this._requested = [...capabilities];
    this._audioOutput = audioOutput;
    if (audioOutput && !this._requested.includes("audio")) this._requested.push("audio");
    this._mediaItems = new Map(); // item id -> {start, chunks, next, sawLast, gap}
    this._policy = reconnect;
    this._heartbeatInterval = heartbeatInterval;
    this._deadAfter = deadAfter;
    this._ackDelay = ackDelay;
    this._ackEvery = ackEvery;
    this._maxBufferMessages = maxBufferMessages;
    this._maxBufferBytes = maxBufferBytes;
    this._connectTimeout = connectTimeout;
    this._closeTimeout = closeTimeout;
    this._onState = onState;
    // The channel: numbering and the resend buffer belong to the session, not a connection.
    this._nextSeq = 1;
    this._handled = 0; // the highest server seq handled
    this._peerAcked = 0; // the highest of our seqs the server acknowledged
    this._buffer = []; // [{seq, data}] not yet acknowledged
    this._bufferBytes = 0;
    this._wireSeq = 0; // our highest seq handed to an open connection
    this._continuing = continueSession; // the archived session the next hello continues
    this._continueAfterRestart = continueAfterRestart;
    if (resumeFrom) this._restore(resumeFrom);
    this._tools = new Map();
    this._toolTasks = new Map(); // call id -> AbortController of a running registered tool
    // Routing: messages still waiting for their turn (oldest first) and open turns.
    this._pendingMessages = [];
    // Seqs of our messages the server answered (a turn started, or a refusal), until
    // acknowledged: the others are sent again, with their key, after a restart.
    this._answered = new Set();
    this._turnForMessage = new Map();
    this._openTurns = new Map();
    this._callOwner = new Map();
    this._link = null;
    this._supervisor = null;
    this._firstReady = null;
    this._stopped = false;
    this._stoppedSignal = deferred();
    this._failure = null;
    this._closing = false;
    this._ending = false;
    this._wake = new Set();
  }

  // -- lifecycle ----------------------------------------------------------------------------

  /** Open (or, with `resumeFrom`, resume) the session; resolves with `ready`. */
  async connect() {
    if (this._supervisor) throw new Error("SessionClient.connect() was already called");
    this._firstReady = deferred();
    this._unwatch = watchOnline(this._wake);
    this._supervisor = this._supervise();
    try {
      return await this._firstReady.promise;
    } catch (error) {
      await this.close();
      throw error;
    }
  }

  /** Send `end` and wait (`closeTimeout`) for the server's close 1000; true if confirmed. */
  async end() {
    if (this._stopped || !this._supervisor) return false;
    try {
      this._send({ type: "end" });
    } catch {
      await this.close();
      return false;
    }
    this._ending = true;
    const timeout = new Promise((resolve) =>
      setTimeout(resolve, this._closeTimeout * 1000, "timeout"),
    );
    const outcome = await Promise.race([this._stoppedSignal.promise, timeout]);
    if (outcome === "timeout") {
      await this.close();
      return false;
    }
    return this._failure == null;
  }

  /** Stop without ending the session: the server keeps it for its resume window. */
  async close() {
    this._closing = true;
    [...this._wake].forEach((fn) => fn());
    this._link?.close(CLOSE_NORMAL, "client closed");
    this._link?.abort("client closed");
    this._stop(null);
    await this._supervisor?.catch(() => {});
  }

  /** Drop the current connection abruptly; the client resumes on a new one. */
  abortConnection() {
    this._link?.abort("aborted by the application");
  }

  get closed() {
    return this._stopped;
  }

  /** The session's resumable state; give it to a new client as `resumeFrom`. */
  snapshot() {
    return {
      url: this.url,
      sessionId: this.sessionId,
      capabilities: this.capabilities,
      nextSeq: this._nextSeq,
      handled: this._handled,
      peerAcked: this._peerAcked,
      unacknowledged: this._buffer.map((entry) => entry.data),
      wireSeq: this._wireSeq, // above it: queued while offline, never sent
    };
  }

  _restore(state) {
    this.sessionId = state.sessionId;
    this.capabilities = state.capabilities ?? [];
    this._nextSeq = state.nextSeq;
    this._handled = state.handled;
    this._peerAcked = state.peerAcked;
    this._buffer = state.unacknowledged.map((data) => ({ seq: JSON.parse(data).seq, data }));
    this._bufferBytes = this._buffer.reduce((sum, entry) => sum + byteLength(entry.data), 0);
    // An older snapshot does not say what went out: count all of it as sent.
    this._wireSeq = state.wireSeq ?? this._nextSeq - 1;
  }

  _changed() {
    if (this._onState && this.sessionId) {
      try {
        this._onState(this.snapshot());
      } catch (error) {
        console.error("onState failed", error);
      }
    }
  }

  // -- sending --------------------------------------------------------------------------------

  /** Send a message; the returned `Turn` receives the frames that answer it. */
  startTurn(content, { parts = null, metadata = null, clientId = null } = {}) {
    this._checkOpen();
    const key = clientId || newMessageKey();
    const seq = this._queueMessage(content, parts, metadata, key);
    const turn = new Turn(seq, key);
    this._turnForMessage.set(seq, turn);
    return turn;
  }

  /** Send a message and collect its turn. */
  ask(content, options) {
    return this.startTurn(content, options).reply();
  }

  /** Send a message (it starts a turn); its frames arrive as `message` events. Returns seq. */
  sendMessage(content, { parts = null, metadata = null, clientId = null } = {}) {
    this._checkOpen();
    return this._queueMessage(content, parts, metadata, clientId || newMessageKey());
  }

  ackToolCall(callId) {
    return this._send({ type: "tool_call_ack", call_id: callId });
  }

  nackToolCall(callId, reason) {
    return this._send({ type: "tool_call_nack", call_id: callId, reason });
  }

  /** Answer a tool call with `result`, or with `error` (then `result` is ignored). */
  sendToolResult(callId, result = null, { error = null } = {}) {
    if (error != null) return this._send({ type: "tool_result", call_id: callId, error });
    return this._send({ type: "tool_result", call_id: callId, result });
  }

  /** New application context for server code and tools (never model instructions). */
  sendContext(context) {
    if (!this.capabilities.includes("context")) {
      throw new Error("the context capability is not in effect for this session");
    }
    return this._send({ type: "context", context });
  }

  /** Cancel the running turn; it ends with a `done` carrying `cancelled: true`. */
  interrupt() {
    return this._send({ type: "interrupt" });
  }

  _queueMessage(content, parts, metadata, clientId) {
    if (!content && !parts?.length) throw new Error("a message needs content or parts");
    // The key travels in the frame: resends, snapshots and continuations keep it.
    const message = { type: "message", client_id: clientId };
    if (content) message.content = content;
    if (parts?.length) message.parts = parts;
    if (metadata) message.metadata = metadata;
    const seq = this._number(message);
    this._pendingMessages.push(seq);
    return seq;
  }

  _send(frame) {
    this._checkOpen();
    return this._number(frame);
  }

  /** Number `frame`, keep it until acknowledged, and write it if a link is live. */
  _number(frame) {
    const data = JSON.stringify({ ...frame, seq: this._nextSeq });
    const bytes = byteLength(data);
    if (
      this._buffer.length >= this._maxBufferMessages ||
      this._bufferBytes + bytes > this._maxBufferBytes
    ) {
      throw new SendBufferFullError("the resend buffer is full; the server has not acknowledged");
    }
    const seq = this._nextSeq++;
    this._buffer.push({ seq, data });
    this._bufferBytes += bytes;
    if (this._link?.state === "open") this._wireSeq = seq;
    this._changed();
    this._link?.writeNumbered(data);
    return seq;
  }

  // -- continuing after a restart (docs/session.md, "Continuing an archived conversation") --

  /**
   * The resume failed: the next hello continues the conversation in a new numbering.
   * Old messages are never replayed blindly (they may have taken effect on the server
   * that went away): turns already answering them end with a RESUME_FAILED error.
   * Messages queued while no connection was up never reached a server, and keyed ones
   * nothing answered yet (a restored snapshot's too) are harmless to send again (the
   * server answers a key it already has with DUPLICATE_MESSAGE): they move to the new
   * numbering, keeping their keys.
   */
  _startContinuation() {
    const unsent = this._buffer
      .map((entry) => JSON.parse(entry.data))
      .filter(
        (frame) =>
          frame.type === "message" &&
          (frame.seq > this._wireSeq || (frame.client_id && !this._answered.has(frame.seq))),
      );
    const kept = new Set(unsent.map((frame) => frame.seq));
    this._endLostTurns(kept);
    Object.assign(this, { _nextSeq: 1, _handled: 0, _peerAcked: 0, _buffer: [], _bufferBytes: 0 });
    this._answered.clear();
    const renumbered = new Map();
    for (const { seq: old, ...frame } of unsent) renumbered.set(old, this._number(frame));
    // Each one sent again waits for its answer (a restored snapshot's too), in order.
    this._pendingMessages = unsent.map((frame) => renumbered.get(frame.seq));
    const turns = new Map();
    for (const [old, turn] of this._turnForMessage) {
      turn.messageSeq = renumbered.get(old);
      turns.set(turn.messageSeq, turn);
    }
    this._turnForMessage = turns;
    this._wireSeq = 0;
    this._continuing = this.sessionId;
  }

  _endLostTurns(kept) {
    const error = {
      code: "RESUME_FAILED",
      message: "the server lost this turn (it restarted); send the message again",
      details: { reason: "continued" },
    };
    for (const seq of this._pendingMessages.filter((seq) => !kept.has(seq))) {
      this._pendingMessages.splice(this._pendingMessages.indexOf(seq), 1);
      const turn = this._turnForMessage.get(seq);
      this._turnForMessage.delete(seq);
      const frame = { type: "error", seq: 0, ref_seq: seq, error };
      this.dispatchEvent(new CustomEvent("message", { detail: frame }));
      turn?._put(frame);
    }
    for (const [turnId, turn] of this._openTurns) {
      const frame = { type: "error", seq: 0, turn_id: turnId, error };
      this.dispatchEvent(new CustomEvent("message", { detail: frame }));
      turn?._put(frame);
    }
    this._openTurns.clear();
    this._callOwner.clear();
    this._mediaItems.clear();
    for (const controller of this._toolTasks.values()) controller.abort();
  }

  _acknowledge(seq) {
    if (seq >= this._nextSeq) {
      throw new ProtocolError(`ack ${seq} is beyond the highest seq sent (${this._nextSeq - 1})`);
    }
    if (seq <= this._peerAcked) return;
    this._peerAcked = seq;
    while (this._buffer.length && this._buffer[0].seq <= seq) {
      const entry = this._buffer.shift();
      this._bufferBytes -= byteLength(entry.data);
      this._answered.delete(entry.seq);
    }
    this._changed();
  }

  /** True for the next message in order, false for a duplicate; a gap is an error. */
  _receiveSeq(seq) {
    if (seq <= this._handled) return false;
    if (seq !== this._handled + 1) {
      throw new ProtocolError(`seq ${seq} skips ahead: expected ${this._handled + 1}`);
    }
    this._handled = seq;
    this._changed();
    return true;
  }

  _checkOpen() {
    if (!this._supervisor) throw new SessionClosedError("not connected: await connect() first");
    if (this._stopped) throw this._failure ?? new SessionClosedError("the session is closed");
    // The server ignores what follows `end`; refusing here says so.
    if (this._ending) throw new SessionClosedError("the session is ending");
  }

  // -- tools ----------------------------------------------------------------------------------

  /**
   * Answer `tool_call`s for `name` with `await fn(arguments, {callId, signal})`.
   * `consent(frame, {signal})` (optional) resolves true to run the tool; `signal` aborts when
   * the server gives up on the call. Register before connecting: tools are declared in the
   * first `hello` and fixed for the session.
   */
  registerTool(name, fn, { description = "", parameters = {}, consent = null } = {}) {
    this._tools.set(name, { spec: { name, description, parameters }, fn, consent });
  }

  get tools() {
    return new Set(this._tools.keys());
  }

  /** True while a registered tool works on `callId` (acknowledged, deciding or running). */
  isHandling(callId) {
    return this._toolTasks.has(callId);
  }

  /** Run the registered flow for a call known from elsewhere (`{id, name, arguments}`). */
  handleToolCall(info, turnId = null) {
    this._startTool({ type: "tool_call", seq: 0, turn_id: turnId, tool_call: info });
  }

  _startTool(frame) {
    const call = frame.tool_call;
    const tool = this._tools.get(call.name);
    if (!tool || this._toolTasks.has(call.id)) return;
    const controller = new AbortController();
    this._toolTasks.set(call.id, controller);
    this._runTool(tool, frame, controller.signal).finally(() => this._toolTasks.delete(call.id));
  }

  async _runTool(tool, frame, signal) {
    const call = frame.tool_call;
    try {
      this.ackToolCall(call.id);
      if (tool.consent && !(await consented(tool.consent, frame, signal))) {
        if (!signal.aborted) this.nackToolCall(call.id, DECLINED_BY_USER);
        return;
      }
      if (signal.aborted) return;
      let value;
      try {
        value = await tool.fn(call.arguments ?? {}, { callId: call.id, signal });
      } catch (error) {
        if (!signal.aborted) this.sendToolResult(call.id, null, { error: describe(error) });
        return;
      }
      if (signal.aborted) return;
      try {
        JSON.stringify(value);
      } catch {
        this.sendToolResult(call.id, null, { error: "the tool's result is not JSON" });
        return;
      }
      this.sendToolResult(call.id, value === undefined ? null : value);
    } catch (error) {
      if (!(error instanceof SessionError)) console.error("tool failed", error);
    }
  }

  // -- routing received messages --------------------------------------------------------------

  /** One binary frame of an open item; frames of an item begun elsewhere are ignored. */
  _mediaChunk(chunk) {
    const item = this._mediaItems.get(chunk.mediaId);
    if (!item) return;
    if (chunk.sequence !== item.next) item.gap = true;
    item.next = chunk.sequence + 1;
    item.sawLast ||= chunk.isLast;
    item.chunks.push(chunk.payload);
  }

  _mediaFrame(frame) {
    if (frame.type === "audio_start") {
      this._mediaItems.set(frame.item_id, {
        start: frame,
        chunks: [],
        next: 0,
        sawLast: false,
        gap: false,
      });
      return;
    }
    const item = this._mediaItems.get(frame.item_id);
    if (!item) return; // begun before a page reload: its bytes are gone
    this._mediaItems.delete(frame.item_id);
    const format = item.start.format ?? {};
    const detail = {
      item_id: frame.item_id,
      turn_id: frame.turn_id,
      format,
      blob: new Blob(item.chunks, { type: format.mime_type ?? "application/octet-stream" }),
      complete: item.sawLast && !item.gap && !frame.lost,
    };
    this.dispatchEvent(new CustomEvent("media", { detail }));
  }

  _deliver(frame) {
    if (frame.type === "audio_start" || frame.type === "audio_end") this._mediaFrame(frame);
    if (frame.type === "tool_call") {
      this._startTool(frame);
    } else if (frame.type === "tool_result") {
      // The server gave up on the call: stop working on it.
      this._toolTasks.get(frame.call_id)?.abort();
    }
    const turn = this._route(frame);
    this.dispatchEvent(new CustomEvent("message", { detail: frame }));
    turn?._put(frame);
  }

  /** The Turn this frame belongs to, or null. */
  _route(frame) {
    if (frame.type === "error" && frame.turn_id == null) {
      const running = runningDuplicate(frame);
      if (running && this._openTurns.has(running)) return this._openTurns.get(running);
      const turn = this._refusal(frame.ref_seq);
      if (running && turn) {
        turn.turnId = running; // the earlier turn answers it: follow that one
        this._openTurns.set(running, turn);
      }
      return turn;
    }
    if (frame.type === "tool_result") {
      const owner = this._callOwner.get(frame.call_id) ?? null;
      this._callOwner.delete(frame.call_id);
      return owner;
    }
    const turnId = frame.turn_id;
    if (typeof turnId !== "string") return null;
    if (!this._openTurns.has(turnId)) this._openTurns.set(turnId, this._claimNewTurn(turnId));
    const turn = this._openTurns.get(turnId);
    if (frame.type === "tool_call" && turn) this._callOwner.set(frame.tool_call.id, turn);
    if (endsTurn(frame)) {
      this._openTurns.delete(turnId);
      for (const [id, owner] of this._callOwner) if (owner === turn) this._callOwner.delete(id);
    }
    return turn;
  }

  _claimNewTurn(turnId) {
    // Messages are handled in seq order and each either starts one turn or is refused
    // with an error naming it (ref_seq), and a session runs one turn at a time: so a new
    // turn answers the oldest message still waiting for an answer.
    const seq = this._pendingMessages.shift();
    if (seq === undefined) return null;
    this._answered.add(seq);
    const turn = this._turnForMessage.get(seq) ?? null;
    this._turnForMessage.delete(seq);
    if (turn) turn.turnId = turnId;
    return turn;
  }

  _refusal(refSeq) {
    const index = this._pendingMessages.indexOf(refSeq);
    if (refSeq == null || index < 0) return null;
    this._pendingMessages.splice(index, 1);
    this._answered.add(refSeq);
    const turn = this._turnForMessage.get(refSeq) ?? null;
    this._turnForMessage.delete(refSeq);
    return turn;
  }

  // -- connections ----------------------------------------------------------------------------

  async _supervise() {
    const retries = new Retries(this._policy, ConnectionLostError);
    let faults = 0; // consecutive closes that blame this client
    let authRetried = false;
    try {
      for (;;) {
        const outcome = await this._connectOnce();
        if (outcome.opened) {
          retries.connected();
          authRetried = false;
        }
        if (this._shouldContinue(outcome)) {
          this._startContinuation();
          continue; // a new numbering on the same conversation, at once
        }
        this._checkTerminal(outcome, authRetried);
        authRetried = outcome.closeCode === CLOSE_UNAUTHENTICATED;
        faults = CLIENT_FAULT_CLOSES.has(outcome.closeCode) ? faults + 1 : 0;
        if (faults >= MAX_CLIENT_FAULTS) {
          throw new ProtocolError("the server refused this client's frames repeatedly", {
            closeCode: outcome.closeCode,
          });
        }
        const delay = retries.nextDelay();
        this._status({ state: "dropped", closeCode: outcome.closeCode, retryIn: delay });
        await backoff(delay, this._wake);
        if (this._closing) throw new Finished();
      }
    } catch (error) {
      if (error instanceof Finished) this._stop(null);
      else if (error instanceof SessionError) this._stop(error);
      else {
        console.error("session client failed", error);
        this._stop(new SessionError(`internal error: ${describe(error)}`));
      }
    }
  }

  _shouldContinue(outcome) {
    return (
      this._continueAfterRestart &&
      this._continuing == null &&
      this.sessionId != null &&
      outcome.closeCode === CLOSE_RESUME_FAILED &&
      !this._closing &&
      !this._ending
    );
  }

  /** Throw when `outcome` ends the client; return when a resume should follow. */
  _checkTerminal(outcome, authRetried) {
    const { closeCode, error } = outcome;
    const options = { code: error?.code ?? null, closeCode, details: error?.details ?? null };
    const message =
      error?.message ??
      (closeCode != null
        ? `closed with ${closeCode}`
        : (outcome.failure ?? "the connection dropped"));
    if (this._closing || closeCode === CLOSE_NORMAL) throw new Finished();
    if (this._ending && closeCode === CLOSE_RESUME_FAILED) throw new Finished(); // `end` took effect
    if (closeCode === CLOSE_UNAUTHENTICATED && (!this._credentialProvider || authRetried)) {
      throw new AuthenticationError(message, options);
    }
    if (closeCode === CLOSE_REPLACED) {
      throw new SessionReplacedError("a newer connection took over the session", options);
    }
    if (this.sessionId == null) {
      if (closeCode === CLOSE_UNAUTHENTICATED) return;
      throw new ConnectError(`could not open the session: ${message}`, options);
    }
    if (closeCode === CLOSE_RESUME_FAILED) throw new ResumeFailedError(message, options);
  }

  async _connectOnce() {
    let credential;
    try {
      credential = this._credentialProvider ? await this._credentialProvider() : this._credential;
    } catch (error) {
      return { opened: false, closeCode: null, error: null, failure: describe(error) };
    }
    let ws;
    try {
      ws = new WebSocket(this.url);
    } catch (error) {
      return { opened: false, closeCode: null, error: null, failure: describe(error) };
    }
    const link = new SessionLink(this, ws, this._hello(credential));
    this._link = link;
    const timer = setTimeout(() => link.abort("connect timeout"), this._connectTimeout * 1000);
    let opened = false;
    try {
      const ready = await link.ready.promise;
      clearTimeout(timer);
      opened = true;
      this._opened(ready);
      if (this._credentialProvider) link.keepCredentialFresh(credential, this._credentialProvider);
    } catch {
      clearTimeout(timer);
    }
    await link.closed.promise;
    this._link = null;
    return { opened, closeCode: link.closeCode, error: link.error, failure: null };
  }

  _opened(ready) {
    this.ready = ready;
    this.connections += 1;
    const continued = this._continuing != null;
    this._continuing = null;
    if (this.sessionId == null || continued) {
      this.sessionId = ready.session_id;
      this.capabilities = ready.capabilities;
    }
    this._changed();
    this._status({ state: "open", resumed: ready.resumed, continued });
    this._firstReady?.resolve(ready);
  }

  _hello(credential) {
    // A registered tool replaces a declared spec of the same name.
    const specs = new Map(this._toolSpecs.map((spec) => [spec.name, spec]));
    for (const [name, tool] of this._tools) specs.set(name, tool.spec);
    const hello = {
      type: "hello",
      protocol: PROTOCOL_VERSION,
      tools: [...specs.values()],
      capabilities: this._requested,
    };
    if (this._audioOutput) hello.audio = { output: this._audioOutput };
    if (credential != null) hello.credential = credential;
    if (this._agent != null) hello.agent = this._agent;
    if (this._continuing != null) {
      // A new numbering: negotiated afresh, like an open.
      if (this._context != null) hello.context = this._context;
      return { ...hello, continue: this._continuing };
    }
    if (this.sessionId == null) {
      if (this._context != null) hello.context = this._context;
      return hello;
    }
    // Capabilities, tools and agent are fixed at open; the server keeps the original set.
    return { ...hello, session_id: this.sessionId, last_seq: this._handled };
  }

  // -- stopping -------------------------------------------------------------------------------

  _stop(error) {
    if (this._stopped) return;
    this._stopped = true;
    this._failure = error;
    this._unwatch?.();
    const turns = new Set([
      ...this._turnForMessage.values(),
      ...this._callOwner.values(),
      ...this._openTurns.values(),
    ]);
    const stopped = error ?? new SessionClosedError("the session stopped before this turn ended");
    for (const turn of turns) turn?._stop(stopped);
    for (const controller of this._toolTasks.values()) controller.abort();
    this._firstReady?.reject(error ?? new SessionClosedError("closed before ready"));
    this._stoppedSignal.resolve();
    this._status({ state: "closed", error });
  }

  _status(detail) {
    this.dispatchEvent(new CustomEvent("status", { detail }));
  }
}

class Finished extends Error {}

async function consented(consent, frame, signal) {
  try {
    return Boolean(await consent(frame, { signal }));
  } catch (error) {
    console.error("consent callback failed; treating the call as declined", error);
    return false;
  }
}

function describe(error) {
  return error?.message || String(error) || "error";
}

// -- RPC ------------------------------------------------------------------------------------

export class RpcError extends Error {
  constructor(message, { code = null, closeCode = null, details = null } = {}) {
    super(message);
    this.name = this.constructor.name;
    this.code = code;
    this.closeCode = closeCode;
    this.details = details;
  }
}
/** An error reply: `code` (`session.not_found`, `invalid_request`, ...), `message`, `details`. */
export class RpcCallError extends RpcError {}
export class RpcAuthenticationError extends RpcError {}
export class RpcConnectError extends RpcError {}
export class RpcConnectionLostError extends RpcError {}
export class RpcTimeoutError extends RpcError {}
export class RpcClosedError extends RpcError {}

const QUERIES = new Set([
  "v1.session.list",
  "v1.session.get",
  "v1.message.list",
  "v1.message.get",
  "v1.turn.list",
  "v1.turn.get",
  "v1.rtc.list",
  "v1.rtc.get",
]);
// Methods whose repeat cannot take effect twice (see the top of this file).
const RETRY_SAFE = new Set([
  ...QUERIES,
  "v1.message.send",
  "v1.session.close",
  "v1.session.open",
  "v1.session.update",
  "v1.rtc.submit_result",
  "v1.rtc.update_status",
]);

class RpcLink {
  constructor(client, ws, connect) {
    this.client = client;
    this.ws = ws;
    this.sentOffset = connect.offset ?? null;
    this.sentEpoch = connect.epoch ?? null;
    this.ready = false;
    this.connected = deferred();
    this.closed = deferred();
    this.closeCode = null;
    this.error = null;
    this.pending = new Map(); // request id -> resolve(frame | null)
    this.lastReceived = now();
    this.probing = false;
    this.timer = null;
    this.dropped = false;
    ws.onopen = () => {
      this.lastReceived = now();
      ws.send(JSON.stringify(connect));
      this._schedule();
    };
    ws.onmessage = (event) => {
      this.lastReceived = now();
      this.probing = false;
      this.client._onFrame(this, event.data);
      this._schedule();
    };
    ws.onclose = (event) => this.drop(event.code === CLOSE_ABNORMAL ? null : event.code);
    ws.onerror = () => {};
  }

  request(id, data) {
    return new Promise((resolve) => {
      if (this.dropped) return resolve(null);
      this.pending.set(id, resolve);
      this.ws.send(data);
    });
  }

  resolve(frame) {
    const resolve = this.pending.get(frame.id);
    this.pending.delete(frame.id);
    resolve?.(frame);
  }

  _schedule() {
    clearTimeout(this.timer);
    if (this.dropped) return;
    const interval = this.client._heartbeatInterval;
    const silentFor = now() - this.lastReceived;
    const dead = interval * this.client._deadAfter;
    if (silentFor >= dead) return this.abort();
    const next = this.ready && !this.probing ? interval : dead;
    this.timer = setTimeout(() => this._onTimer(), Math.max(0, (next - silentFor) * 1000));
  }

  _onTimer() {
    if (this.dropped) return;
    if (now() - this.lastReceived >= this.client._heartbeatInterval * this.client._deadAfter) {
      return this.abort();
    }
    if (this.ready && !this.probing) {
      // Any frame back proves the link alive; `pong` is the cheapest one.
      this.probing = true;
      try {
        this.ws.send(JSON.stringify({ type: "ping" }));
      } catch {}
    }
    this._schedule();
  }

  abort() {
    try {
      this.ws.close(CLOSE_NORMAL, "connection presumed dead");
    } catch {}
    this.drop(null);
  }

  drop(code) {
    if (this.dropped) return;
    this.dropped = true;
    clearTimeout(this.timer);
    this.ws.onopen = this.ws.onmessage = this.ws.onclose = null;
    if (this.closeCode == null) this.closeCode = code;
    // Whether these requests reached the server is unknown: their callers decide.
    for (const resolve of this.pending.values()) resolve(null);
    this.pending.clear();
    this.client._linkDropped(this);
    this.connected.reject(new RpcError("closed before connected"));
    this.closed.resolve();
  }
}

/** All of a user's conversations over `GET /v1/rpc`; see the top of this file. */
export class RpcClient extends EventTarget {
  constructor(
    url,
    {
      token = null,
      tokenProvider = null, // () => token or Promise<token>, asked before every connection
      offset = null, // the position of the last update the application applied...
      epoch = null, // ...and its epoch: the server replays what came after
      reconnect = new ReconnectPolicy(),
      requestTimeout = 30, // seconds for a reply, repeats included
      connectTimeout = 10,
      heartbeatInterval = 15, // seconds of silence before a probe
      deadAfter = 2.5, // intervals of silence before the link is dropped
    } = {},
  ) {
    super();
    this.url = websocketUrl(url);
    this.userId = null;
    this.offset = offset; // the offset of the last update dispatched
    this.epoch = epoch;
    this.recovered = false; // the latest `connected.recovered`
    this.connections = 0;
    this._token = token;
    this._tokenProvider = tokenProvider;
    this._policy = reconnect;
    this._requestTimeout = requestTimeout;
    this._connectTimeout = connectTimeout;
    this._heartbeatInterval = heartbeatInterval;
    this._deadAfter = deadAfter;
    this._ids = 1;
    this._link = null;
    this._online = deferred();
    this._first = null;
    this._stopped = false;
    this._failure = null;
    this._closing = false;
    this._supervisor = null;
    this._wake = new Set();
  }

  async connect() {
    if (this._supervisor) throw new Error("RpcClient.connect() was already called");
    this._first = deferred();
    this._unwatch = watchOnline(this._wake);
    this._supervisor = this._supervise();
    return this._first.promise;
  }

  async close() {
    this._closing = true;
    [...this._wake].forEach((fn) => fn());
    this._link?.abort();
    this._stop(null);
    await this._supervisor?.catch(() => {});
  }

  /** Drop the current connection abruptly; the client reconnects and recovers. */
  abortConnection() {
    this._link?.abort();
  }

  get connected() {
    return Boolean(this._link?.ready && !this._link.dropped);
  }

  // -- methods ------------------------------------------------------------------------------

  /**
   * Call `method`; resolves with `{result, updates, repeated}` or rejects with `RpcCallError`.
   * `updates` are informational: the same updates arrive as `update` events.
   */
  async call(method, params = {}) {
    this._checkUsable();
    const id = String(this._ids++);
    const data = JSON.stringify({ id, method, params });
    let timer;
    const timeout = new Promise((_, reject) => {
      timer = setTimeout(
        () => reject(new RpcTimeoutError(`${method}: no reply within ${this._requestTimeout} s`)),
        this._requestTimeout * 1000,
      );
    });
    try {
      const { frame, repeated } = await Promise.race([this._attempts(id, method, data), timeout]);
      if (frame.error) {
        const { code, message, details } = frame.error;
        // `repeated`: the request went out again after a drop (see messageSend).
        throw Object.assign(new RpcCallError(message, { code, details }), { repeated });
      }
      return { result: frame.result, updates: frame.updates ?? null, repeated };
    } finally {
      clearTimeout(timer);
    }
  }

  async _attempts(id, method, data) {
    let repeated = false;
    for (;;) {
      const link = await this._waitLink();
      const frame = await link.request(id, data);
      if (frame) return { frame, repeated };
      this._checkUsable();
      // Whether the request reached the server is unknown: only a call whose repeat
      // cannot take effect twice goes out again.
      if (!RETRY_SAFE.has(method)) {
        throw new RpcConnectionLostError(
          `${method}: the connection dropped before the reply; the outcome is unknown`,
        );
      }
      repeated = true;
    }
  }

  async _waitLink() {
    for (;;) {
      this._checkUsable();
      const link = this._link;
      if (link?.ready && !link.dropped) return link;
      await this._online.promise;
    }
  }

  _checkUsable() {
    if (!this._supervisor) throw new RpcClosedError("not connected: await connect() first");
    if (this._stopped || this._closing)
      throw this._failure ?? new RpcClosedError("the client is closed");
  }

  sessionList({ cursor = "", limit = 20 } = {}) {
    return this._result("v1.session.list", { cursor, limit });
  }
  sessionGet(sessionId) {
    return this._result("v1.session.get", { session_id: sessionId });
  }
  sessionClose(sessionId, { clientId = "" } = {}) {
    return this.call("v1.session.close", { session_id: sessionId, client_id: clientId });
  }
  sessionOpen(sessionId) {
    return this.call("v1.session.open", { session_id: sessionId });
  }
  /** `title` renames; `deletedAt` a Date or RFC 3339 string soft-deletes, null restores. */
  sessionUpdate(sessionId, { title, deletedAt } = {}) {
    const params = { session_id: sessionId };
    if (title !== undefined) params.title = title;
    if (deletedAt !== undefined) {
      params.deleted_at = deletedAt instanceof Date ? deletedAt.toISOString() : deletedAt;
    }
    return this.call("v1.session.update", params);
  }
  sessionFork({
    sessionId,
    messageId,
    content,
    clientMessageId = "",
    clientSessionId = "",
    limit = 200,
  }) {
    return this.call("v1.session.fork", {
      old_server_session_id: sessionId,
      old_server_message_id: messageId,
      content_data: content,
      new_client_message_id: clientMessageId,
      new_client_session_id: clientSessionId,
      limit,
    });
  }
  sessionCompact(sessionId, { customInstruction = "" } = {}) {
    return this.call("v1.session.compact", {
      session_id: sessionId,
      custom_instruction: customInstruction,
    });
  }

  /**
   * Send a message (a new session when `serverSessionId` is empty). `clientId`
   * deduplicates; a repeat after a drop that meets `client_id_conflict` resolves with the
   * first attempt's ids and `deduplicated: true`.
   */
  async messageSend(
    content,
    {
      clientId = null,
      serverSessionId = "",
      clientSessionId = "",
      agent = "",
      metadata = null,
    } = {},
  ) {
    const params = {
      content_data: content,
      client_id: clientId ?? crypto.randomUUID(),
      server_session_id: serverSessionId,
      client_session_id: clientSessionId,
      agent,
    };
    if (metadata) params.metadata = metadata;
    try {
      return await this.call("v1.message.send", params);
    } catch (error) {
      // Only a conflict answering a repeat means the first attempt landed.
      if (error instanceof RpcCallError && error.code === "client_id_conflict" && error.repeated) {
        const { session_id, message_id } = error.details ?? {};
        return {
          result: { session_id, message_id, turn_id: "" },
          updates: null,
          repeated: true,
          deduplicated: true,
        };
      }
      throw error;
    }
  }
  messageList(sessionId, { cursor = "", limit = 50 } = {}) {
    return this._result("v1.message.list", { session_id: sessionId, cursor, limit });
  }
  messageGet(messageId) {
    return this._result("v1.message.get", { message_id: messageId });
  }
  turnStop(sessionId, { clientId = "" } = {}) {
    return this.call("v1.turn.stop", { session_id: sessionId, client_id: clientId });
  }
  turnList(sessionId, { cursor = "", limit = 50 } = {}) {
    return this._result("v1.turn.list", { session_id: sessionId, cursor, limit });
  }
  turnGet(turnId) {
    return this._result("v1.turn.get", { turn_id: turnId });
  }
  async rtcUpdateStatus(rtcId, status, { clientId = "", reason = "" } = {}) {
    try {
      return await this.call("v1.rtc.update_status", {
        rtc_id: rtcId,
        status,
        client_id: clientId,
        reason,
      });
    } catch (error) {
      // A repeated `rejected` meets invalid_transition: the first attempt landed if the
      // Rtc is in the requested state.
      if (
        error instanceof RpcCallError &&
        error.code === "rtc.invalid_transition" &&
        error.repeated
      ) {
        const rtc = await this.rtcGet(rtcId);
        if (rtc.status === status) return { result: rtc, updates: null, repeated: true };
      }
      throw error;
    }
  }
  rtcSubmitResult(rtcId, { success, result = null, error = "", clientId = "" }) {
    return this.call("v1.rtc.submit_result", {
      rtc_id: rtcId,
      success,
      result,
      error,
      client_id: clientId,
    });
  }
  rtcList(sessionId, { cursor = "", limit = 50 } = {}) {
    return this._result("v1.rtc.list", { session_id: sessionId, cursor, limit });
  }
  rtcGet(rtcId) {
    return this._result("v1.rtc.get", { rtc_id: rtcId });
  }

  async _result(method, params) {
    return (await this.call(method, params)).result;
  }

  // -- received frames ------------------------------------------------------------------------

  _onFrame(link, data) {
    let frame;
    try {
      frame = JSON.parse(data);
    } catch {
      console.error("unreadable frame from the server");
      return;
    }
    if (frame.id != null) {
      link.resolve(frame);
    } else if (frame.type === "update" && frame.update) {
      this._takeUpdate(frame.update);
    } else if (frame.type === "gap") {
      this._takeGap(frame.offset);
    } else if (frame.type === "live" && frame.live) {
      this.dispatchEvent(new CustomEvent("live", { detail: frame.live }));
    } else if (frame.type === "connected") {
      this._onConnected(link, frame);
    } else if (frame.type === "error" && frame.error) {
      link.error = frame.error; // the close that follows is explained by it
    }
  }

  _onConnected(link, frame) {
    this.userId = frame.user_id;
    this.recovered = frame.recovered;
    this.connections += 1;
    let reason = null;
    if (link.sentOffset != null) {
      if (link.sentEpoch != null && frame.epoch !== link.sentEpoch) reason = "epoch_changed";
      else if (!frame.recovered) reason = "not_recovered";
    }
    if (reason || link.sentOffset == null) {
      // A first connect or a lost position: the stream starts at the server's head, and
      // the application (re)loads its state with queries.
      this.offset = frame.offset;
      this.epoch = frame.epoch;
    }
    link.ready = true;
    link.connected.resolve();
    this._online.resolve();
    if (reason)
      this.dispatchEvent(
        new CustomEvent("reset", { detail: { reason, epoch: frame.epoch, offset: frame.offset } }),
      );
    this.dispatchEvent(
      new CustomEvent("status", {
        detail: {
          state: "open",
          recovered: frame.recovered,
          reset: reason,
          first: this.connections === 1,
        },
      }),
    );
    this._first?.resolve(frame);
  }

  _takeUpdate(update) {
    if (this.offset != null && update.offset <= this.offset) return; // a repeat
    this.offset = update.offset;
    this.dispatchEvent(new CustomEvent("update", { detail: update }));
  }

  _takeGap(offset) {
    if (this.offset != null && offset <= this.offset) return;
    this.offset = offset;
  }

  // -- connections ----------------------------------------------------------------------------

  async _supervise() {
    const retries = new Retries(this._policy, RpcConnectionLostError);
    let authRetried = false; // the previous connection was refused 4401 before opening
    try {
      for (;;) {
        const outcome = await this._connectOnce();
        if (outcome.opened) {
          retries.connected();
          authRetried = false;
        }
        if (this._closing) throw new Finished();
        const error = outcome.error;
        const refused =
          outcome.closeCode === CLOSE_UNAUTHENTICATED || error?.code === "unauthenticated";
        // With a provider, an expired token (4401 after a connection worked) is retried
        // once with a fresh one.
        const retry = this._tokenProvider && !authRetried && this.connections > 0;
        authRetried = outcome.closeCode === CLOSE_UNAUTHENTICATED;
        if (refused && !retry) {
          throw new RpcAuthenticationError(error?.message ?? "unauthenticated", {
            closeCode: outcome.closeCode,
          });
        }
        if (this.connections === 0) {
          throw new RpcConnectError(
            `could not connect: ${error?.message ?? outcome.closeCode ?? "the connection failed"}`,
          );
        }
        const delay = retries.nextDelay();
        this.dispatchEvent(
          new CustomEvent("status", {
            detail: { state: "dropped", closeCode: outcome.closeCode, retryIn: delay },
          }),
        );
        await backoff(delay, this._wake);
        if (this._closing) throw new Finished();
      }
    } catch (error) {
      if (error instanceof Finished) this._stop(null);
      else if (error instanceof RpcError) this._stop(error);
      else {
        console.error("rpc client failed", error);
        this._stop(new RpcError(`internal error: ${describe(error)}`));
      }
    }
  }

  async _connectOnce() {
    let token;
    try {
      token = this._tokenProvider ? await this._tokenProvider() : this._token;
    } catch (error) {
      return { opened: false, closeCode: null, error: { message: describe(error) } };
    }
    const connect = { type: "connect" };
    if (token != null) connect.token = token;
    if (this.offset != null) connect.offset = this.offset;
    if (this.epoch != null) connect.epoch = this.epoch;
    let ws;
    try {
      ws = new WebSocket(this.url);
    } catch (error) {
      return { opened: false, closeCode: null, error: { message: describe(error) } };
    }
    const link = new RpcLink(this, ws, connect);
    this._link = link;
    const timer = setTimeout(() => link.abort(), this._connectTimeout * 1000);
    let opened = false;
    try {
      await link.connected.promise;
      opened = true;
    } catch {
      // closed before `connected`
    }
    clearTimeout(timer);
    let stopRefresh = null;
    if (opened && this._tokenProvider) {
      stopRefresh = keepCredentialFresh(token, this._tokenProvider, (fresh) => {
        if (ws.readyState === WebSocket.OPEN) {
          ws.send(JSON.stringify({ type: "credential", credential: fresh }));
        }
      });
    }
    await link.closed.promise;
    stopRefresh?.();
    this._link = null;
    return { opened, closeCode: link.closeCode, error: link.error };
  }

  _linkDropped(link) {
    // Callers wait for the next link from now on (a stopped client keeps waking them).
    if (link === this._link && !this._stopped) this._online = deferred();
  }

  _stop(error) {
    if (this._stopped) return;
    this._stopped = true;
    this._failure = error;
    this._unwatch?.();
    this._online.resolve(); // wake callers waiting for a link: they see the stop
    this._first?.reject(error ?? new RpcClosedError("closed before connected"));
    this.dispatchEvent(new CustomEvent("status", { detail: { state: "closed", error } }));
  }
}

// -- media ----------------------------------------------------------------------------------

/** The part type for a MIME type: image, audio, video or file. */
export function partType(mimeType) {
  const major = (mimeType || "").split("/")[0];
  return ["image", "audio", "video"].includes(major) ? major : "file";
}

function authHeaders(token) {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function mediaError(response) {
  let code = `HTTP_${response.status}`;
  let message = response.statusText;
  try {
    const body = await response.json();
    code = body.error?.code ?? code;
    message = body.error?.message ?? message;
  } catch {}
  return Object.assign(new Error(message), { code, status: response.status });
}

/**
 * True when `grant.upload_url` is not the server's own `/media/upload/{id}` but object
 * storage's (a presigned URL, `media: s3`): the client then confirms the upload.
 */
export function needsConfirm(grant) {
  const path = new URL(grant.upload_url, globalThis.location?.href ?? "http://localhost/").pathname;
  return !path.endsWith(`/media/upload/${grant.upload_id}`);
}

/**
 * Upload `file` (a File or Blob) for `sessionId` and return the message part naming it:
 * `{type, media: {storage_ref, mime_type, filename, size_bytes}}`. Two requests: the upload
 * URL (with the credential), then the bytes (the URL is the credential, only the headers
 * the grant lists). When the bytes went to object storage, a third:
 * `POST /media/confirm-upload/{id}`, whose answer ends the upload (the store's bucket must
 * allow this page's origin to PUT: its CORS rules, docs/storage.md).
 */
export async function uploadFile(file, { sessionId, token = null, baseUrl = "" }) {
  const mimeType = file.type || "application/octet-stream";
  const filename = file.name || "upload";
  const response = await fetch(`${baseUrl}/media/request-upload`, {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders(token) },
    body: JSON.stringify({
      session_id: sessionId,
      filename,
      mime_type: mimeType,
      size_bytes: file.size,
    }),
  });
  if (!response.ok) throw await mediaError(response);
  const grant = await response.json();
  const put = await fetch(grant.upload_url, {
    method: grant.method ?? "PUT",
    headers: grant.headers ?? {},
    body: file,
  });
  if (!put.ok) throw await mediaError(put);
  if (needsConfirm(grant)) {
    const confirmed = await fetch(
      `${baseUrl}/media/confirm-upload/${encodeURIComponent(grant.upload_id)}`,
      { method: "POST" },
    );
    if (!confirmed.ok) throw await mediaError(confirmed);
  }
  return {
    type: partType(mimeType),
    media: { storage_ref: grant.storage_ref, mime_type: mimeType, filename, size_bytes: file.size },
  };
}

/** `omnia://sessions/<session>/media/<media>` -> {sessionId, mediaId}, or null. */
export function parseStorageRef(ref) {
  const match = /^omnia:\/\/sessions\/([^/]+)\/media\/([^/]+)$/.exec(ref ?? "");
  return match
    ? { sessionId: decodeURIComponent(match[1]), mediaId: decodeURIComponent(match[2]) }
    : null;
}

/**
 * The bytes of stored media as a Blob (owner only: the credential goes along). With
 * `media: s3` the server answers 307 to a presigned URL; the browser follows it and, the
 * origin being another, leaves the Authorization header behind (the URL is the credential).
 */
export async function fetchMedia(storageRef, { token = null, baseUrl = "" } = {}) {
  const ref = parseStorageRef(storageRef);
  if (!ref) throw new Error(`not a storage reference: ${storageRef}`);
  const path = `/media/download/${encodeURIComponent(ref.sessionId)}/${encodeURIComponent(ref.mediaId)}`;
  const response = await fetch(baseUrl + path, { headers: authHeaders(token) });
  if (!response.ok) throw await mediaError(response);
  return response.blob();
}

// -- voice calls over /ws (docs/voice.md, docs/web.md "Voice") -------------------------------

/** The format a call proposes on its first frame: what the embedded agent hears. */
export const DEFAULT_CALL_FORMAT = Object.freeze({ codec: "pcm16", sample_rate: 16000, channels: 1 });
const CALL_MEDIA_ID = "c1"; // the caller's audio item (at most 12 bytes)
const FLAG_IS_LAST = 0x04;
// Errors that end the call (the server drops its later frames until `hangup`).
const CALL_FAILURES = new Set(["DUPLEX_ERROR", "UNSATISFIABLE_FORMAT"]);

/** Encode one OMNI frame (type 1, MediaChunk): the inverse of `decodeOmni`. */
export function encodeOmni({ mediaId, sequence = 0, isLast = false, metadata = {}, payload }) {
  const meta = encoder.encode(JSON.stringify(metadata));
  const id = encoder.encode(mediaId);
  if (id.length > 12) throw new RangeError("a MediaID is at most 12 bytes");
  const body = payload instanceof Uint8Array ? payload : new Uint8Array(payload);
  const frame = new Uint8Array(OMNI_HEADER + meta.length + body.length);
  const view = new DataView(frame.buffer);
  frame.set(encoder.encode("OMNI"), 0);
  view.setUint8(4, 1);
  view.setUint8(5, isLast ? FLAG_IS_LAST : 0);
  view.setUint16(6, 1);
  view.setUint32(8, meta.length);
  view.setUint32(12, body.length);
  view.setUint32(16, sequence >>> 0);
  frame.set(id, 20);
  frame.set(meta, OMNI_HEADER);
  frame.set(body, OMNI_HEADER + meta.length);
  return frame.buffer;
}

const pcmMime = (format) =>
  format.codec === "pcm16" || format.codec === "pcm"
    ? `audio/pcm;rate=${format.sample_rate}`
    : `audio/${format.codec}`;

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/**
 * One voice call on its own `/ws` connection (`binary=true`), the wire only: no
 * microphone, no speaker (see `VoiceConversation` for both).
 *
 *   const call = new VoiceCall("/ws?agent=demo", { token });
 *   call.addEventListener("audio", (e) => play(e.detail.payload, e.detail.format));
 *   call.addEventListener("interrupt", () => stopPlaying());   // barge-in: at once
 *   await call.connect();                                      // `connected`
 *   call.sendAudio(pcm16);   // the first frame starts the call with `format` in its metadata
 *   call.hangup();
 *
 * Events: `status` {state: connecting|open|reconnecting|closed, resumed, error},
 * `config` (the runtime's `session_config`: capture at that format from then on),
 * `audio` {mediaId, sequence, isLast, payload, format} (binary OMNI frames, or base64
 * `media_chunk` from a server that sends those), `transcript` {role: "user", text} (what
 * the agent heard), `text` {text} (the agent's words as they stream), `done` {text} (a
 * spoken turn ended), `interrupt` (barge-in: drop buffered audio now), `error` {code,
 * message, details, fatal} (`fatal`: the call failed; hang up).
 *
 * A connection that drops without `hangup` leaves the call parked on the server for its
 * grace window (`graceWindow`, the server's `realtime_grace_window`): the client
 * reconnects with `?resume=<session id>` and backoff until then. Audio sent while
 * disconnected is dropped (`sendAudio` answers false): audio is never resent. A resume
 * the server refuses (`resumed: false`) ends the call: status closed with a
 * `SESSION_EXPIRED` error. With `credentialProvider`, a 4401 close resumes with a fresh
 * token, and the token is refreshed before its `exp` as `openOmniaSocket` does. Each
 * connection attempt waits `connectTimeout` s for `connected`. A `hangup()` while
 * disconnected cannot reach the server: the parked call ends with its window.
 */
export class VoiceCall extends EventTarget {
  constructor(
    path = "/ws",
    {
      token = null,
      credentialProvider = null,
      format = DEFAULT_CALL_FORMAT,
      graceWindow = 15,
      connectTimeout = 15,
      reconnect = new ReconnectPolicy({ initial: 0.2, maximum: 2 }),
    } = {},
  ) {
    super();
    const url = new URL(path, "http://placeholder/");
    url.searchParams.set("binary", "true");
    this.path = url.pathname + url.search;
    Object.assign(this, { token, credentialProvider, graceWindow, connectTimeout, reconnect });
    this.proposed = { ...format };
    this.sessionId = null;
    this.config = null; // the runtime's format (`session_config`), once it came
    this.state = "idle";
    this.framesSent = 0;
    this._ws = null;
    this._started = false; // the first frame went: the server holds a call
    this._failed = false;
    this._closing = false;
    this._wake = new Set();
  }

  get open() {
    return this._ws?.readyState === WebSocket.OPEN && this.state === "open";
  }

  /** Open the connection; resolves on `connected`. Rejects with ConnectError. */
  async connect() {
    this._status("connecting");
    try {
      await this._open(null);
    } catch (error) {
      this._status("closed", { error });
      throw error;
    }
  }

  /**
   * Send caller audio (an ArrayBuffer or Uint8Array in the proposed format until
   * `config` comes, in `config`'s after). The first frame carries the format and starts
   * the call. False when the frame was dropped (not connected, or the call failed).
   */
  sendAudio(pcm, { isLast = false } = {}) {
    if (!this.open || this._failed) return false;
    const metadata = { session_id: this.sessionId };
    if (!this._started) {
      const fmt = this.proposed;
      Object.assign(metadata, {
        mime_type: pcmMime(fmt),
        codec: fmt.codec,
        sample_rate: fmt.sample_rate,
        channels: fmt.channels,
      });
    }
    this._ws.send(
      encodeOmni({ mediaId: CALL_MEDIA_ID, sequence: this.framesSent, isLast, metadata, payload: pcm }),
    );
    this._started = true;
    this.framesSent += 1;
    return true;
  }

  /** End the call on purpose (`hangup`: not parked) and close the connection. */
  hangup() {
    if (this._closing) return;
    this._closing = true;
    const ws = this._ws;
    if (ws?.readyState === WebSocket.OPEN) {
      if (this._started || this._failed) ws.send(JSON.stringify({ type: "hangup" }));
      ws.close(CLOSE_NORMAL);
    }
    [...this._wake].forEach((fn) => fn());
    this._status("closed");
  }

  _status(state, extra = {}) {
    if (this.state === "closed") return;
    this.state = state;
    this.dispatchEvent(new CustomEvent("status", { detail: { state, ...extra } }));
  }

  _emit(type, detail = {}) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** One connection; resolves with `connected` (rejects when it closes before). */
  _open(resume) {
    const url = new URL(this.path, "http://placeholder/");
    if (resume) url.searchParams.set("resume", resume);
    const ws = openOmniaSocket(url.pathname + url.search, {
      token: this.token,
      credentialProvider: this.credentialProvider,
    });
    ws.binaryType = "arraybuffer";
    this._ws = ws;
    return new Promise((resolve, reject) => {
      let connected = false;
      // No `connected` in time: give up this attempt (its close rejects).
      const timer = setTimeout(() => connected || ws.close(), this.connectTimeout * 1000);
      ws.addEventListener("message", (event) => {
        if (ws !== this._ws) return;
        if (typeof event.data !== "string") return this._onBinary(event.data);
        let frame;
        try {
          frame = JSON.parse(event.data);
        } catch {
          return;
        }
        if (frame.type === "connected") {
          connected = true;
          clearTimeout(timer);
          this._onConnected(frame, resume);
          resolve(frame);
        } else this._onFrame(frame);
      });
      ws.addEventListener("close", (event) => {
        clearTimeout(timer);
        if (ws !== this._ws) return;
        if (!connected) {
          reject(
            new ConnectError(`the voice connection closed (${event.code})`, {
              closeCode: event.code,
            }),
          );
        } else this._dropped(event);
      });
    });
  }

  _onConnected(frame, resume) {
    this.sessionId = frame.session_id;
    const resumed = frame.connected?.resumed;
    if (resume && resumed === false) {
      // The call is gone (its window passed, or the server restarted): nothing to resume.
      this._closing = true;
      this._ws.close(CLOSE_NORMAL);
      const error = new SessionError("the call could not be resumed", { code: "SESSION_EXPIRED" });
      this._emit("error", { code: "SESSION_EXPIRED", message: error.message, fatal: true });
      this._status("closed", { error });
      return;
    }
    this._status("open", { resumed: Boolean(resumed) });
  }

  _onFrame(frame) {
    switch (frame.type) {
      case "session_config":
        this.config = { ...frame.session_config };
        if (this.config.codec === "pcm") this.config.codec = "pcm16";
        this._emit("config", this.config);
        break;
      case "media_chunk": {
        const chunk = frame.media_chunk ?? {};
        this._emit("audio", {
          mediaId: chunk.media_id,
          sequence: chunk.sequence,
          isLast: Boolean(chunk.is_last),
          payload: base64Bytes(chunk.data ?? ""),
          format: this.config,
        });
        break;
      }
      case "chunk":
        if (frame.role === "user") this._emit("transcript", { role: "user", text: frame.content ?? "" });
        else this._emit("text", { text: frame.content ?? "" });
        break;
      case "done":
        this._emit("done", { text: frame.content ?? "" });
        break;
      case "interrupt":
        this._emit("interrupt");
        break;
      case "error": {
        const { code, message, details } = frame.error ?? {};
        // Before `session_config` an error refuses the call (a limit, the runtime).
        const fatal = CALL_FAILURES.has(code) || (this._started && this.config == null);
        if (fatal) this._failed = true;
        this._emit("error", { code, message, details: details ?? {}, fatal });
        break;
      }
    }
  }

  _onBinary(data) {
    let frame;
    try {
      frame = decodeOmni(data);
    } catch (error) {
      return console.warn("voice: a malformed binary frame", describe(error));
    }
    const meta = frame.metadata ?? {};
    const format = meta.sample_rate
      ? { codec: meta.codec ?? "pcm16", sample_rate: meta.sample_rate, channels: meta.channels ?? 1 }
      : this.config;
    this._emit("audio", {
      mediaId: frame.mediaId,
      sequence: frame.sequence,
      isLast: frame.isLast,
      payload: frame.payload,
      format,
    });
  }

  /** The connection went without our `hangup`: resume the parked call in its window. */
  async _dropped(event) {
    if (this._closing || this.state === "closed") return;
    if (event.code === CLOSE_UNAUTHENTICATED && !this.credentialProvider) {
      const error = new AuthenticationError("the credential was refused", { closeCode: 4401 });
      return this._status("closed", { error });
    }
    const resume = this._started && !this._failed ? this.sessionId : null;
    this._status("reconnecting", { closeCode: event.code });
    const deadline = now() + (resume ? this.graceWindow : (this.reconnect.giveUpAfter ?? 120));
    for (let attempt = 0; !this._closing; attempt++) {
      if (now() >= deadline) {
        const error = new ConnectionLostError("no connection within the call's grace window");
        return this._status("closed", { error });
      }
      await backoff(Math.min(this.reconnect.delay(attempt), deadline - now()), this._wake);
      if (this._closing) return;
      if (this.credentialProvider && event.code === CLOSE_UNAUTHENTICATED) {
        try {
          this.token = await this.credentialProvider();
        } catch {}
      }
      try {
        await this._open(resume);
        if (!resume) this._started = this._failed = false; // a fresh session: a new call
        return;
      } catch {}
    }
  }
}

/**
 * Plays pcm16 audio through Web Audio as it arrives: each chunk is scheduled right after
 * the previous one; `stop()` silences everything scheduled at once (barge-in).
 * `playedSamples` counts what was heard, `cutSamples` what a `stop()` dropped.
 */
export class VoicePlayer extends EventTarget {
  constructor(context, { lead = 0.05 } = {}) {
    super();
    this.context = context;
    this.lead = lead; // seconds of margin before the first chunk after silence
    this.playedSamples = 0;
    this.cutSamples = 0;
    this._sources = new Set();
    this._next = 0;
  }

  get playing() {
    return this._sources.size > 0;
  }

  /** Queue pcm16 little-endian bytes of `format` (codec pcm16 only). */
  play(bytes, format) {
    if (!format || (format.codec !== "pcm16" && format.codec !== "pcm")) return;
    const channels = format.channels || 1;
    const frames = Math.floor(bytes.byteLength / 2 / channels);
    if (!frames) return;
    const view = new DataView(bytes.buffer, bytes.byteOffset, frames * 2 * channels);
    const buffer = this.context.createBuffer(channels, frames, format.sample_rate);
    for (let c = 0; c < channels; c++) {
      const out = buffer.getChannelData(c);
      for (let i = 0; i < frames; i++) out[i] = view.getInt16((i * channels + c) * 2, true) / 32768;
    }
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const at = Math.max(this._next, this.context.currentTime + this.lead);
    source.startAt = at;
    this._next = at + buffer.duration;
    const wasPlaying = this.playing;
    this._sources.add(source);
    source.addEventListener("ended", () => {
      if (!this._sources.delete(source)) return; // stopped: counted by stop()
      this.playedSamples += frames;
      if (!this.playing) this._changed();
    });
    source.start(at);
    if (!wasPlaying) this._changed();
  }

  /** Silence at once and forget what is queued; returns the samples dropped. */
  stop() {
    const t = this.context.currentTime;
    let cut = 0;
    for (const source of this._sources) {
      const { length, sampleRate } = source.buffer;
      const heard = Math.min(length, Math.max(0, Math.round((t - source.startAt) * sampleRate)));
      this.playedSamples += heard;
      cut += length - heard;
      source.stop();
    }
    const was = this.playing;
    this._sources.clear();
    this._next = 0;
    this.cutSamples += cut;
    if (was) this._changed();
    return cut;
  }

  _changed() {
    this.dispatchEvent(new CustomEvent("playing", { detail: { playing: this.playing } }));
  }
}

/**
 * The microphone as pcm16 frames: `getUserMedia`, then an AudioWorklet
 * (`voice-worklet.js`, served beside this file) that mixes to mono and resamples to
 * `rate`, posting `frameMs` frames; `setRate()` follows a `session_config`.
 */
export class Microphone {
  constructor(
    context,
    {
      rate = DEFAULT_CALL_FORMAT.sample_rate,
      frameMs = 20,
      workletUrl = new URL("./voice-worklet.js", import.meta.url),
      // Echo cancellation keeps the agent from hearing (and barging in on) itself. Noise
      // suppression and gain control are off: they turned a clear "hello" into "slow" for
      // the embedded agent's recogniser (docs/web.md, "Voice").
      constraints = { echoCancellation: true, noiseSuppression: false, autoGainControl: false },
    } = {},
  ) {
    Object.assign(this, { context, rate, frameMs, workletUrl, constraints });
    this.onframe = null; // (ArrayBuffer of pcm16) => void
    this._stream = null;
    this._node = null;
  }

  async start() {
    if (!navigator.mediaDevices?.getUserMedia || !this.context.audioWorklet) {
      // Browsers offer both only to a secure page: https, or http on localhost.
      throw Object.assign(new Error("the microphone needs an https (or localhost) page"), {
        name: "NotSupportedError",
      });
    }
    this._stream = await navigator.mediaDevices.getUserMedia({ audio: this.constraints });
    await this.context.audioWorklet.addModule(this.workletUrl);
    const source = this.context.createMediaStreamSource(this._stream);
    // No output: the node is a sink, pulled by the graph (it must not be heard).
    this._node = new AudioWorkletNode(this.context, "portico-capture", {
      numberOfOutputs: 0,
      processorOptions: { rate: this.rate, frameMs: this.frameMs },
    });
    this._node.port.onmessage = (event) => this.onframe?.(event.data);
    source.connect(this._node);
  }

  setRate(rate) {
    this.rate = rate;
    this._node?.port.postMessage({ rate });
  }

  stop() {
    this._stream?.getTracks().forEach((track) => track.stop());
    if (this._node) {
      this._node.port.onmessage = null;
      this._node.disconnect();
    }
    this._stream = this._node = null;
  }
}

/**
 * A spoken conversation: the microphone to a `VoiceCall`, its audio to a `VoicePlayer`,
 * barge-in stopping playback at once. Start it from a user gesture (a click): browsers
 * only let a page start audio and ask for the microphone then.
 *
 *   const voice = new VoiceConversation("/ws?agent=demo", { token });
 *   voice.addEventListener("state", (e) => show(e.detail.state)); // listening, speaking...
 *   voice.addEventListener("transcript", (e) => addLine("user", e.detail.text));
 *   voice.addEventListener("text", (e) => appendReply(e.detail.text));
 *   voice.addEventListener("done", () => endReply());
 *   await voice.start();
 *   ...
 *   voice.stop();                                            // hangup
 *
 * States: starting, listening, speaking (agent audio playing), reconnecting, ended,
 * failed (`error` says why). Other events are the `VoiceCall`'s, passed on.
 */
export class VoiceConversation extends EventTarget {
  constructor(path = "/ws", { token = null, credentialProvider = null, workletUrl, graceWindow } = {}) {
    super();
    this.call = new VoiceCall(path, { token, credentialProvider, graceWindow });
    this.context = null;
    this.player = null;
    this.microphone = null;
    this.interrupts = 0;
    this.resumes = 0; // reconnections that took the parked call back
    this.state = "idle";
    this._workletUrl = workletUrl;
    this._interrupted = new Set(); // media ids cut by a barge-in: their stragglers are dropped
    for (const type of ["transcript", "text", "done", "config", "error"])
      this.call.addEventListener(type, (e) => this._pass(type, e.detail));
    this.call.addEventListener("config", (e) => this.microphone?.setRate(e.detail.sample_rate));
    this.call.addEventListener("audio", (e) => this._onAudio(e.detail));
    this.call.addEventListener("interrupt", () => this._interrupt());
    this.call.addEventListener("status", (e) => this._onStatus(e.detail));
    this.call.addEventListener("error", (e) => e.detail.fatal && this.stop(e.detail));
  }

  get sessionId() {
    return this.call.sessionId;
  }

  async start() {
    this._state("starting");
    this.context = new AudioContext();
    this.player = new VoicePlayer(this.context);
    this.player.addEventListener("playing", () => this._onPlaying());
    const options = { rate: this.call.proposed.sample_rate };
    if (this._workletUrl) options.workletUrl = this._workletUrl;
    this.microphone = new Microphone(this.context, options);
    this.microphone.onframe = (pcm) => this.call.sendAudio(pcm);
    try {
      await this.context.resume();
      // The socket first: the call starts with the first frame, so the caller's first
      // words are not lost to the connection's setup.
      await this.call.connect();
      await this.microphone.start();
    } catch (error) {
      if (this._over) return; // stopped meanwhile: not a failure
      this.stop({ code: error.code ?? error.name, message: error.message });
      throw error;
    }
    if (this._over) this.microphone.stop(); // stopped while the browser asked for it
  }

  get _over() {
    return this.state === "ended" || this.state === "failed";
  }

  /** Hang up (or, given `error`, end as failed) and release the microphone. */
  stop(error = null) {
    if (this._over) return;
    this.call.hangup();
    this.microphone?.stop();
    this.player?.stop();
    this.context?.close().catch(() => {});
    this._state(error ? "failed" : "ended", error ? { error } : {});
  }

  _pass(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  _state(state, extra = {}) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, ...extra } }));
  }

  _onAudio({ mediaId, payload, format }) {
    if (this._interrupted.has(mediaId) || !this.player) return;
    this._item = mediaId;
    this.player.play(payload, format ?? this.call.config);
  }

  _interrupt() {
    if (this._item) this._interrupted.add(this._item);
    const cut = this.player?.stop() ?? 0;
    this.interrupts += 1;
    this._pass("interrupt", { cutSamples: cut });
  }

  _onPlaying() {
    if (this.state === "listening" || this.state === "speaking")
      this._state(this.player.playing ? "speaking" : "listening");
  }

  _onStatus({ state, error, resumed }) {
    if (state === "open") {
      if (resumed) this.resumes += 1;
      this._state(this.player?.playing ? "speaking" : "listening");
    }
    else if (state === "reconnecting") {
      this.player?.stop(); // what was in flight is lost: audio is never resent
      this._state("reconnecting");
    } else if (state === "closed" && error) this.stop({ code: error.code ?? error.name, message: error.message });
  }
}
