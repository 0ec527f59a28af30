// The demo chat page: a sidebar over /v1/rpc, live conversations over /v1/session.
// See docs/web.md for which channel does what, and why.

import {
  DECLINED_BY_USER,
  RpcAuthenticationError,
  RpcClient,
  SessionClient,
  VoiceConversation,
  fetchMedia,
  partType,
  uploadFile,
} from "./portico.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const AGENT = query.get("agent") || null;
const TAB_ID = crypto.randomUUID(); // the client_id of Rtcs this tab answers
const HISTORY_PAGE = 50; // messages per v1.message.list page (the server's default)

// -- storage: the token and the sidebar cache in localStorage, live sessions per tab ---------

const TOKEN_KEY = "portico.token";
const token = localStorage.getItem(TOKEN_KEY) || null;
const scope = fnv1a(`${location.host}|${token ?? ""}`); // caches never cross users or servers
const CACHE_KEY = `portico.sidebar.${scope}`;
const LIVE_KEY = (sessionId) => `portico.live.${scope}.${sessionId}`;

function fnv1a(text) {
  let hash = 0x811c9dc5;
  for (const char of text) {
    hash ^= char.codePointAt(0);
    hash = Math.imul(hash, 0x01000193) >>> 0;
  }
  return hash.toString(16);
}

function readJson(storage, key) {
  try {
    return JSON.parse(storage.getItem(key) ?? "null");
  } catch {
    return null;
  }
}

// -- browser tools: what the agent may ask this page for ------------------------------------

const answers = new Map(); // call id -> the user's typed answer (ask_user)

const TOOLS = {
  get_time: {
    description: "The device's local date, time and time zone.",
    categories: ["time"],
    run: () => ({
      time: new Date().toLocaleString(navigator.language, { dateStyle: "full", timeStyle: "long" }),
      iso: new Date().toISOString(),
      time_zone: Intl.DateTimeFormat().resolvedOptions().timeZone,
    }),
  },
  get_timezone: {
    description: "The device's time zone and UTC offset.",
    categories: ["location"],
    run: () => {
      const minutes = -new Date().getTimezoneOffset();
      const sign = minutes < 0 ? "-" : "+";
      const hh = String(Math.floor(Math.abs(minutes) / 60)).padStart(2, "0");
      const mm = String(Math.abs(minutes) % 60).padStart(2, "0");
      return {
        time_zone: Intl.DateTimeFormat().resolvedOptions().timeZone,
        utc_offset: `${sign}${hh}:${mm}`,
      };
    },
  },
  get_locale: {
    description: "The page's language and locale settings.",
    categories: ["locale"],
    run: () => ({ locale: navigator.language, languages: [...navigator.languages] }),
  },
  ask_user: {
    description: "Ask the user a question; returns their answer.",
    parameters: {
      type: "object",
      properties: { question: { type: "string" } },
      required: ["question"],
    },
    categories: ["prompt"],
    run: (args, { callId }) => ({ answer: answers.get(callId) ?? "" }),
  },
};

async function runTool(name, args, callId) {
  const tool = TOOLS[name];
  if (!tool) throw new Error(`this page has no tool named ${name}`);
  return tool.run(args ?? {}, { callId });
}

// -- the /v1/rpc connection: sidebar, history, actions -----------------------------------------

const cache = readJson(localStorage, CACHE_KEY);
const rpc = new RpcClient("/v1/rpc", {
  token,
  offset: cache?.offset ?? null,
  epoch: cache?.epoch ?? null,
});

const sidebar = {
  sessions: new Map((cache?.sessions ?? []).map((s) => [s.id, s])),
  nextCursor: cache?.nextCursor ?? "",
  consistent: Boolean(cache), // the map reflects every update up to rpc.offset
  editing: null,
  confirmDelete: null,
  elements: new Map(),
};
const liveTexts = new Map(); // RPC live chunks by message id: index -> delta
const runningTurns = new Map(); // session id -> Set of turn ids pending or running

let saveTimer = null;
function saveCache() {
  clearTimeout(saveTimer);
  saveTimer = setTimeout(() => {
    if (!sidebar.consistent || rpc.offset == null) return; // never pair an offset with stale state
    const sessions = [...sidebar.sessions.values()];
    const state = {
      epoch: rpc.epoch,
      offset: rpc.offset,
      nextCursor: sidebar.nextCursor,
      sessions,
    };
    localStorage.setItem(CACHE_KEY, JSON.stringify(state));
  }, 50);
}

function upsertSession(session) {
  sidebar.reloading?.set(session.id, session);
  const known = sidebar.sessions.get(session.id);
  if (known && known.updated_at > session.updated_at) return; // an older copy (a query racing an update)
  if (session.deleted_at) {
    sidebar.sessions.delete(session.id);
    lives.get(session.id)?.end();
    if (view.sessionId === session.id) navigate(null);
  } else {
    sidebar.sessions.set(session.id, session);
  }
  if (view.sessionId === session.id) renderHeader();
  renderSidebar();
}

async function reloadSidebar() {
  sidebar.consistent = false;
  sidebar.reloading = new Map(); // sessions updates changed while the query ran
  try {
    const page = await rpc.sessionList({ limit: 20 });
    const fresh = new Map(page.items.map((s) => [s.id, s]));
    for (const [id, session] of sidebar.reloading) {
      if (session.deleted_at) fresh.delete(id);
      else if (!fresh.has(id) || fresh.get(id).updated_at < session.updated_at)
        fresh.set(id, session);
    }
    sidebar.sessions = fresh;
    sidebar.nextCursor = page.next_cursor;
    sidebar.consistent = true;
    renderSidebar();
    saveCache();
  } catch (error) {
    showNotice(`Could not load the conversations: ${error.message}`);
  } finally {
    sidebar.reloading = null;
  }
}

async function loadMoreSessions() {
  const page = await rpc.sessionList({ cursor: sidebar.nextCursor, limit: 20 });
  for (const session of page.items)
    if (!sidebar.sessions.has(session.id)) sidebar.sessions.set(session.id, session);
  sidebar.nextCursor = page.next_cursor;
  renderSidebar();
  saveCache();
}

rpc.addEventListener("update", (event) => {
  const update = event.detail;
  update.items.forEach((item, index) => applyEntity(item.entity, update.data_list[index]));
  saveCache();
});
rpc.addEventListener("reset", () => {
  reloadSidebar();
  if (view.sessionId) select(view.sessionId); // the open conversation may have missed changes too
});
rpc.addEventListener("live", (event) => onRpcLive(event.detail));
rpc.addEventListener("status", (event) => {
  const { state, recovered, first } = event.detail;
  connection.rpc = state;
  if (state === "dropped") connection.drops += 1;
  if (state === "open") {
    document.body.dataset.recovered = String(recovered);
    if (first && !recovered && !event.detail.reset) reloadSidebar();
  }
  if (state === "closed" && event.detail.error instanceof RpcAuthenticationError) showAuthHint();
  else if (state === "closed" && event.detail.error)
    showNotice(`Disconnected: ${event.detail.error.message}`);
  renderConnection();
});

function applyEntity(kind, entity) {
  if (kind === "session") return upsertSession(entity);
  if (kind === "turn") return trackTurn(entity);
  if (kind === "message") noteActivity(entity);
  if (entity.session_id !== view.sessionId) {
    if (kind === "message" && entity.status !== "streaming") liveTexts.delete(entity.id);
    return;
  }
  later(() => {
    if (kind === "message") applyMessage(entity);
    else if (kind === "rtc") applyRtc(entity);
  });
}

function trackTurn(turn) {
  const running = runningTurns.get(turn.session_id) ?? new Set();
  if (turn.status === "pending" || turn.status === "running") running.add(turn.id);
  else running.delete(turn.id);
  runningTurns.set(turn.session_id, running);
  if (turn.session_id !== view.sessionId) return;
  later(() => {
    const item = lastReply(turn.id);
    if (turn.status === "cancelled" && item) {
      item.cancelled = true;
      scheduleRender(item);
    } else if (turn.status === "failed" && turn.error) {
      const reply = item ?? replyItem(turn.id);
      if (reply.status !== "completed") {
        reply.status = "failed";
        reply.error = turn.error.message;
        scheduleRender(reply);
      }
    }
    renderBusy();
  });
}

function onRpcLive(live) {
  const deltas = liveTexts.get(live.message_id) ?? new Map();
  liveTexts.set(live.message_id, deltas.set(live.index, live.delta));
  if (live.session_id !== view.sessionId) return;
  later(() => {
    const key = view.messageKeys.get(live.message_id);
    const item = (key && view.items.get(key)) ?? replyItem(live.turn_id);
    item.id = live.message_id;
    // A live /v1/session conversation streams over its own exactly-once channel, but
    // not the part of a reply streamed before this page loaded (`item.snapshot`).
    if (lives.has(live.session_id) && !item.snapshot) return;
    showStreamed(item);
    scheduleRender(item);
  });
}

/** The reply's text so far: what `message.list` said it held (a page loaded mid-reply),
 * then the live chunks after it, in order. Live frames are best effort: a missing one
 * shows as "catching up" until the final update repairs the text. */
function showStreamed(item) {
  if (item.final != null) return;
  const deltas = liveTexts.get(item.id) ?? new Map();
  let text = item.snapshot?.text ?? "";
  let index = item.snapshot?.chunks ?? 0;
  while (deltas.has(index)) text += deltas.get(index++);
  item.text = text;
  item.gapped = [...deltas.keys()].some((later) => later > index);
  item.status = "streaming";
}

// -- live conversations over /v1/session -----------------------------------------------------

const lives = new Map(); // session id -> LiveConversation, the sessions this tab holds
let voice = null; // the VoiceConversation running, if any
let leavingVoice = false; // the user opened another conversation: the call ends, the view stays
const CONTINUED_NOTICE = "The server restarted: this conversation goes on.";
// Refusals shown with their message instead of as a notice: an invalid one fails its
// line; a duplicate is a line the server already had, answered (see showDuplicate).
const QUIET_REFUSALS = new Set(["INVALID_MESSAGE", "DUPLICATE_MESSAGE"]);

class LiveConversation {
  constructor(resumeFrom = null) {
    this.streams = new Map(); // reply item key -> text streamed so far
    this.calls = new Map(); // turn id -> ids of its tool calls: text after one is a new reply
    this.consents = new Map(); // call id -> resolve(allowed) while the user decides
    this.preAnswers = new Map(); // call id -> allowed, for calls answered from the archive
    this.openTurns = 0;
    this.status = "connecting";
    this.client = new SessionClient("/v1/session", {
      credential: token,
      agent: AGENT,
      resumeFrom,
      // After a server restart the conversation goes on in a new numbering (docs/session.md).
      continueAfterRestart: true,
      // The agent's streamed media (the demo's `beep`): played when each item ends.
      audioOutput: [{ codec: "wav" }, { codec: "pcm16" }, { codec: "mp3" }],
      onState: (state) => sessionStorage.setItem(LIVE_KEY(state.sessionId), JSON.stringify(state)),
    });
    for (const [name, tool] of Object.entries(TOOLS)) {
      this.client.registerTool(name, (args, { callId }) => tool.run(args, { callId }), {
        description: tool.description,
        parameters: tool.parameters ?? { type: "object", properties: {} },
        consent: (frame, { signal }) => this.consent(frame, signal),
      });
    }
    this.client.addEventListener("message", (event) => this.onFrame(event.detail));
    this.client.addEventListener("media", (event) => this.onMedia(event.detail));
    this.client.addEventListener("status", (event) => this.onStatus(event.detail));
  }

  get sessionId() {
    return this.client.sessionId;
  }

  async connect() {
    await this.client.connect();
    lives.set(this.sessionId, this);
  }

  end() {
    sessionStorage.removeItem(LIVE_KEY(this.sessionId));
    lives.delete(this.sessionId);
    this.client.end();
  }

  consent(frame, signal) {
    const call = frame.tool_call;
    if (this.preAnswers.has(call.id)) return this.preAnswers.get(call.id);
    return new Promise((resolve) => {
      this.consents.set(call.id, resolve);
      signal.addEventListener("abort", () => {
        this.consents.delete(call.id);
        resolve(false);
      });
      this.showCall(call, "sent");
    });
  }

  showCall(call, status) {
    if (view.sessionId !== this.sessionId) return;
    later(() => {
      const item = toolItem(call.id);
      Object.assign(item, {
        name: call.name,
        args: call.arguments ?? item.args,
        consent: call.consent_message ?? item.consent,
        categories: call.categories ?? item.categories,
      });
      if (!isTerminal(item.status)) item.status = status;
      scheduleRender(item);
    });
  }

  onFrame(frame) {
    const here = view.sessionId === this.sessionId;
    switch (frame.type) {
      case "chunk": {
        const key = replyKey(frame.turn_id, this.segment(frame.turn_id));
        this.streams.set(key, (this.streams.get(key) ?? "") + frame.content);
        if (here) later(() => this.refreshReply(frame.turn_id));
        break;
      }
      case "done": {
        const segment = this.segment(frame.turn_id);
        this.endTurn(frame.turn_id);
        if (here) {
          later(() => {
            const item = replyItem(frame.turn_id, null, segment);
            // `content` is the whole turn's text; after a tool call this message holds
            // only what came after it (the archive's update brings its exact text).
            if (frame.content != null && !segment) item.final = frame.content;
            else item.final ??= item.text;
            if (frame.parts) item.parts = frame.parts;
            item.status = "completed";
            item.cancelled = Boolean(frame.cancelled);
            scheduleRender(item);
          });
        }
        break;
      }
      case "error":
        if (frame.turn_id != null) {
          const segment = this.segment(frame.turn_id);
          this.endTurn(frame.turn_id);
          if (here) {
            later(() => {
              const item = replyItem(frame.turn_id, null, segment);
              item.status = "failed";
              item.error = frame.error.message;
              scheduleRender(item);
            });
          }
        } else if (here && frame.ref_seq != null && !QUIET_REFUSALS.has(frame.error.code)) {
          showNotice(`${frame.error.code}: ${frame.error.message}`);
        }
        break;
      case "tool_call":
        this.calls.set(frame.turn_id, (this.calls.get(frame.turn_id) ?? new Set()).add(frame.tool_call.id));
        this.showCall(frame.tool_call, "sent");
        break;
      case "tool_result": // the server ended a call nobody answered in time
        if (here) {
          later(() => {
            const item = toolItem(frame.call_id);
            item.status = "timeout";
            item.error = frame.error;
            scheduleRender(item);
          });
        }
        break;
    }
    renderBusy();
  }

  /** How many tool calls of the turn came so far: its current reply message's number. */
  segment(turnId) {
    return this.calls.get(turnId)?.size ?? 0;
  }

  endTurn(turnId) {
    const segments = this.segment(turnId);
    for (let segment = 0; segment <= segments; segment++)
      this.streams.delete(replyKey(turnId, segment));
    this.calls.delete(turnId);
  }

  /** A streamed media item, whole: shown with its reply (an incomplete one is dropped).
   * The archive keeps it as a part of that reply, which replaces this copy once its
   * update arrives (and is what a reloaded page shows). */
  onMedia(media) {
    if (!media.complete || view.sessionId !== this.sessionId) return;
    const mime = media.format.mime_type ?? "";
    const type = partType(mime);
    if (type === "file") return; // the demo plays sounds and shows pictures; nothing else
    const url = URL.createObjectURL(media.blob);
    const segment = this.segment(media.turn_id);
    later(() => {
      const item = replyItem(media.turn_id, null, segment);
      if (item.status === "completed" && item.parts?.some(archivedMedia)) return;
      item.streamed = [
        ...(item.streamed ?? []),
        { part: { type, media: { mime_type: mime, filename: `streamed ${type}` } }, url },
      ];
      scheduleRender(item);
    });
  }

  refreshReply(turnId) {
    const item = replyItem(turnId, null, this.segment(turnId));
    if (item.final != null || item.snapshot) return; // begun before a reload: see showStreamed
    item.text = this.streams.get(item.key) ?? item.text;
    item.status = "streaming";
    scheduleRender(item);
  }

  onStatus(detail) {
    this.status = detail.state;
    if (detail.state === "dropped") connection.drops += 1;
    if (detail.state === "open" && detail.continued && view.sessionId === this.sessionId) {
      showNotice(CONTINUED_NOTICE);
    }
    if (detail.state === "closed") {
      sessionStorage.removeItem(LIVE_KEY(this.sessionId));
      lives.delete(this.sessionId);
      for (const resolve of this.consents.values()) resolve(false);
      this.consents.clear();
      if (detail.error && view.sessionId === this.sessionId) {
        const why =
          detail.error.code === "RESUME_FAILED"
            ? "it can no longer be resumed (the server restarted, or the resume window passed)"
            : detail.error.message;
        showNotice(`This conversation's live session ended: ${why}. It continues over /v1/rpc.`);
        renderHeader();
      }
    }
    renderConnection();
    renderBusy();
  }
}

function resumeLive(sessionId) {
  const saved = readJson(sessionStorage, LIVE_KEY(sessionId));
  if (!saved || saved.sessionId !== sessionId) return null;
  const live = new LiveConversation(saved);
  lives.set(sessionId, live);
  live.client.connect().catch(() => {}); // a failure closes it: onStatus takes it back out
  return live;
}

async function openLive() {
  const live = new LiveConversation();
  await live.connect();
  const id = live.sessionId;
  view.sessionId = id;
  history.replaceState(null, "", `#s=${encodeURIComponent(id)}`);
  renderHeader();
  renderSidebar();
  return live;
}

// -- the conversation view ---------------------------------------------------------------------

const view = {
  sessionId: null,
  items: new Map(), // key -> item; the DOM order is the archive's (global_offset)
  turnCalls: new Map(), // turn id -> offsets of its toolcall_input messages
  messageKeys: new Map(), // assistant message id -> the key of its item
  loading: false,
  queue: [],
  generation: 0,
  attachments: [],
  rendering: new Set(),
  frame: null,
};

/** Run `fn` now, or after the history being loaded (so events land on top of it). */
function later(fn) {
  if (view.loading) view.queue.push(fn);
  else fn();
}

function newItem(key, kind, offset = null) {
  let item = view.items.get(key);
  if (item) {
    if (item.offset == null && offset) item.offset = offset;
    return item;
  }
  item = { key, kind, offset, el: document.createElement("article") };
  item.el.className = `msg ${kind}`;
  item.el.dataset.key = key;
  view.items.set(key, item);
  place(item);
  $("empty").hidden = true;
  return item;
}

function place(item) {
  const list = $("messages");
  if (item.offset) {
    for (const child of list.children) {
      const other = view.items.get(child.dataset.key);
      if (other?.offset && other.offset > item.offset) return list.insertBefore(item.el, child);
    }
  }
  list.append(item.el);
}

/** A turn's reply is archived split at its tool calls (docs/storage.md): its
 * `segment`-th message holds the text after that many calls. */
function replyKey(turnId, segment = 0) {
  return segment ? `r:${turnId}:${segment}` : `r:${turnId}`;
}

function replyItem(turnId, offset = null, segment = 0) {
  const item = newItem(replyKey(turnId, segment), "reply", offset);
  item.turnId ??= turnId;
  item.text ??= "";
  item.status ??= "streaming";
  return item;
}

function toolItem(callId, offset = null) {
  const item = newItem(`t:${callId}`, "tool", offset);
  item.id = callId;
  item.status ??= "pending";
  return item;
}

function applyMessage(m) {
  const data = m.content_data;
  const spoken = m.metadata?.source === "voice"; // a voice call's turn (docs/voice.md)
  if (m.content_type === "toolcall_input" && data && typeof data === "object") {
    const calls = view.turnCalls.get(m.turn_id) ?? new Set();
    view.turnCalls.set(m.turn_id, calls.add(m.global_offset));
    const item = toolItem(data.id, m.global_offset);
    item.name ??= data.name;
    item.args ??= data.arguments;
    scheduleRender(item);
  } else if (m.content_type === "toolcall_output" && data && typeof data === "object") {
    const item = toolItem(data.id, m.global_offset);
    item.name ??= data.name;
    Object.assign(item, { status: data.status, result: data.result, error: data.error });
    scheduleRender(item);
  } else if (m.role === "user") {
    const key = `u:${m.client_id || m.metadata?.client_message_id || m.id}`;
    const item = newItem(key, "user", m.global_offset);
    Object.assign(item, { id: m.id, text: String(data ?? ""), status: "sent" });
    if (m.parts?.length) item.parts = m.parts;
    if (spoken) item.el.dataset.source = "voice";
    scheduleRender(item);
  } else if (m.role === "assistant" && m.content_type === "markdown") {
    const item = m.turn_id
      ? replyItem(m.turn_id, m.global_offset, callsBefore(m))
      : newItem(`m:${m.id}`, "reply", m.global_offset);
    item.id = m.id;
    view.messageKeys.set(m.id, item.key);
    if (spoken) item.el.dataset.source = "voice";
    item.text ??= "";
    if (m.status === "completed" || m.status === "failed") {
      item.final = String(data ?? "");
      item.status = m.status;
      if (m.parts?.length) item.parts = m.parts;
      if (item.parts?.some(archivedMedia)) delete item.streamed; // the archived copy replaces it
      liveTexts.delete(m.id);
    } else {
      if (m.streamed_chunks) item.snapshot = { text: String(data ?? ""), chunks: m.streamed_chunks };
      if (item.snapshot || !lives.has(m.session_id)) showStreamed(item);
      else item.status = "streaming";
    }
    scheduleRender(item);
  } else if (m.content_type === "summary") {
    const item = newItem(`m:${m.id}`, "note", m.global_offset);
    item.text = "Earlier messages were summarised here.";
    scheduleRender(item);
  }
}

/** The turn's last reply message shown (the one a stop or failure belongs to), if any. */
function lastReply(turnId) {
  let last = null;
  for (const item of view.items.values())
    if (item.kind === "reply" && item.turnId === turnId && (!last || item.offset > last.offset))
      last = item;
  return last;
}

/** How many of the turn's tool calls come before the message: its reply segment. */
function callsBefore(m) {
  let count = 0;
  for (const offset of view.turnCalls.get(m.turn_id) ?? []) if (offset < m.global_offset) count++;
  return count;
}

const archivedMedia = (part) => Boolean(part.media?.storage_ref);

function applyRtc(rtc) {
  const item = toolItem(rtc.id);
  item.name ??= rtc.name;
  item.args ??= rtc.arguments;
  // What the agent asked the user, as the live view showed it (not the tool's description).
  item.consent ??= rtc.consent_message ?? undefined;
  if (rtc.categories?.length) item.categories ??= rtc.categories;
  // Keep the furthest state: archive updates, session frames and clicks interleave.
  const rank = { pending: 0, sent: 1, executing: 2 };
  item.owner = rtc.client_id; // empty while no RPC client has taken the call
  if (isTerminal(rtc.status)) {
    Object.assign(item, { status: rtc.status, result: rtc.result, error: rtc.error });
  } else if (!isTerminal(item.status) && rank[rtc.status] >= (rank[item.status] ?? 0)) {
    item.status = rtc.status;
  }
  scheduleRender(item);
}

const isTerminal = (status) => ["completed", "failed", "rejected", "timeout"].includes(status);

function clearView() {
  for (const item of view.items.values()) item.el.remove();
  view.items.clear();
  view.turnCalls.clear();
  view.messageKeys.clear();
  view.queue = [];
  $("empty").hidden = false;
}

async function select(sessionId) {
  if (voice) {
    leavingVoice = true;
    voice.stop();
    leavingVoice = false;
  }
  const generation = ++view.generation;
  clearView();
  view.loading = false; // a load still running for the previous selection no longer counts
  view.sessionId = sessionId;
  clearAttachments();
  hideNotice();
  hideDetails();
  renderHeader();
  renderSidebar();
  renderBusy();
  if (!sessionId) return;
  if (!lives.has(sessionId)) resumeLive(sessionId);
  renderHeader();
  view.loading = true;
  try {
    let cursor = "";
    do {
      const page = await rpc.messageList(sessionId, { cursor, limit: HISTORY_PAGE });
      if (generation !== view.generation) return;
      page.items.forEach(applyMessage);
      cursor = page.next_cursor;
    } while (cursor);
    const [rtcs, turns] = await Promise.all([
      rpc.rtcList(sessionId, { limit: 50 }),
      rpc.turnList(sessionId, { limit: 10 }),
    ]);
    if (generation !== view.generation) return;
    rtcs.items.forEach(applyRtc);
    runningTurns.delete(sessionId); // what the archive says now, not what updates said before
    turns.items.forEach((turn) => trackTurn(turn));
  } catch (error) {
    if (generation !== view.generation) return;
    showNotice(
      error.code === "session.not_found"
        ? "That conversation does not exist."
        : `Could not load the conversation: ${error.message}`,
    );
  } finally {
    if (generation === view.generation) {
      view.loading = false;
      view.queue.splice(0).forEach((fn) => fn());
      const live = lives.get(sessionId);
      const turns = new Set([...(live?.streams.keys() ?? [])].map((key) => key.split(":")[1]));
      for (const turnId of turns) live.refreshReply(turnId);
      renderBusy();
    }
  }
}

function navigate(sessionId) {
  const hash = sessionId ? `#s=${encodeURIComponent(sessionId)}` : "";
  if (location.hash !== hash)
    history.pushState(null, "", hash || location.pathname + location.search);
  select(sessionId);
}

function hashSession() {
  const match = /^#s=(.+)$/.exec(location.hash);
  return match ? decodeURIComponent(match[1]) : null;
}

// -- rendering -----------------------------------------------------------------------------------

function scheduleRender(item) {
  view.rendering.add(item);
  view.frame ??= requestAnimationFrame(() => {
    view.frame = null;
    const list = $("messages");
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    for (const pending of view.rendering) render(pending);
    view.rendering.clear();
    if (atBottom) list.scrollTop = list.scrollHeight;
  });
}

function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value == null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.filter((child) => child != null));
  return node;
}

function render(item) {
  const el = item.el;
  el.dataset.role = item.kind === "reply" ? "assistant" : item.kind;
  el.dataset.status = item.cancelled ? "cancelled" : (item.status ?? "");
  if (item.kind === "user") return renderUser(item);
  if (item.kind === "reply") return renderReply(item);
  if (item.kind === "tool") return renderTool(item);
  el.replaceChildren(h("p", { class: "note", text: item.text }));
}

function renderUser(item) {
  const body = h("div", { class: "bubble" });
  if (item.text) body.append(h("p", { class: "text", text: item.text }));
  if (item.parts?.length) body.append(renderParts(item.parts, item.localUrls));
  const actions = h("div", { class: "actions" });
  if (item.status === "failed")
    actions.append(h("span", { class: "failed", text: `Not sent: ${item.error ?? ""}` }));
  if (item.id && !item.forking) {
    actions.append(
      h("button", {
        type: "button",
        class: "fork",
        title: "Edit this message into a new conversation",
        onclick: () => startFork(item),
        text: "Fork",
      }),
    );
  }
  const children = [body, actions];
  if (item.forking) children.push(forkEditor(item));
  replaceKeepingFocus(item.el, children);
}

function forkEditor(item) {
  const input = h("textarea", { class: "fork-input", rows: "2", "aria-label": "Forked message" });
  input.value = item.text;
  keepDraft(item, "forkDraft", input);
  const submit = async () => {
    const content = input.value.trim();
    if (!content) return;
    item.forking = false;
    render(item);
    try {
      const title = sidebar.sessions.get(view.sessionId)?.title || "Conversation";
      const { result } = await rpc.sessionFork({
        sessionId: view.sessionId,
        messageId: item.id,
        content,
        clientMessageId: crypto.randomUUID(),
      });
      rpc
        .sessionUpdate(result.session_id, { title: `${title} (fork)`.slice(0, 256) })
        .catch(() => {});
      navigate(result.session_id);
    } catch (error) {
      showNotice(`Could not fork: ${error.message}`);
    }
  };
  return h(
    "div",
    { class: "fork-editor" },
    input,
    h("button", {
      type: "button",
      class: "primary fork-submit",
      onclick: submit,
      text: "Fork conversation",
    }),
    h("button", {
      type: "button",
      onclick: () => ((item.forking = false), render(item)),
      text: "Cancel",
    }),
  );
}

function startFork(item) {
  item.forking = true;
  item.forkDraft = null;
  render(item);
  item.el.querySelector(".fork-input")?.focus();
}

function renderReply(item) {
  const content = h("div", { class: "markdown" });
  const text = item.final ?? item.text ?? "";
  // The reply message before a tool call the agent made first holds nothing to show.
  const empty = item.status === "completed" && !text && !item.parts?.length && !item.streamed;
  item.el.hidden = empty && !item.cancelled;
  content.append(renderMarkdown(text));
  if (item.status === "streaming")
    content.append(h("span", { class: "cursor", "aria-hidden": "true" }));
  const children = [h("div", { class: "bubble" }, content)];
  const streamed = item.streamed ?? [];
  const parts = [...(item.parts ?? []), ...streamed.map((s) => s.part)];
  const urls = [...(item.parts ?? []).map(() => null), ...streamed.map((s) => s.url)];
  if (parts.length) children[0].append(renderParts(parts, urls));
  const meta = [];
  if (item.cancelled) meta.push("stopped");
  if (item.gapped && item.final == null) meta.push("catching up…");
  if (item.status === "failed") meta.push(`failed${item.error ? `: ${item.error}` : ""}`);
  if (meta.length) children.push(h("p", { class: "meta", text: meta.join(" · ") }));
  item.el.replaceChildren(...children);
}

const STATUS_LABELS = {
  pending: "Waiting for you",
  sent: "Waiting for you",
  executing: "Running…",
  completed: "Allowed",
  failed: "Failed",
  rejected: "Declined",
  timeout: "Timed out",
};

function renderTool(item) {
  const tool = TOOLS[item.name];
  const el = item.el;
  el.dataset.name = item.name ?? "";
  const consent = item.consent ?? tool?.description ?? `The agent wants to run ${item.name}.`;
  const categories = item.categories ?? tool?.categories ?? [];
  const header = h(
    "header",
    {},
    h("span", { class: "icon", "aria-hidden": "true", text: "⚙" }),
    h("strong", { class: "tool-name", text: item.name ?? "tool" }),
    ...categories.map((category) => h("span", { class: "category", text: category })),
    h("span", {
      class: "tool-status",
      text: answerable(item) ? "Waiting for you" : (STATUS_LABELS[item.status] ?? item.status),
    }),
  );
  const children = [header, h("p", { class: "consent", text: consent })];
  const args = item.args && Object.keys(item.args).length ? JSON.stringify(item.args) : null;
  if (args) children.push(h("code", { class: "arguments", text: args }));
  if (answerable(item)) {
    let answer = null;
    if (item.name === "ask_user") {
      answer = h("input", {
        class: "answer",
        type: "text",
        placeholder: item.args?.question ?? "Your answer",
        "aria-label": "Your answer",
      });
      keepDraft(item, "answerDraft", answer);
    }
    const decide = (allowed) => () => {
      if (answer) answers.set(item.id, answer.value);
      answerTool(item, allowed);
    };
    children.push(
      h(
        "div",
        { class: "decision" },
        answer,
        h("button", {
          type: "button",
          class: "primary allow",
          onclick: decide(true),
          text: item.name === "ask_user" ? "Answer" : "Allow",
        }),
        h("button", { type: "button", class: "decline", onclick: decide(false), text: "Decline" }),
      ),
    );
  }
  if (item.status === "completed" && item.result !== undefined) {
    children.push(h("code", { class: "result", text: `→ ${JSON.stringify(item.result)}` }));
  }
  if (item.error && item.status !== "completed")
    children.push(h("p", { class: "meta", text: item.error }));
  replaceKeepingFocus(el, children);
}

/** Bind `input` to `item[key]`, so that a re-render (an update arrived) keeps what was typed. */
function keepDraft(item, key, input) {
  if (item[key] != null) input.value = item[key];
  input.addEventListener("input", () => (item[key] = input.value));
}

/** Replace `el`'s children; a field that had the focus gets it back in its new copy. */
function replaceKeepingFocus(el, children) {
  const focused = el.contains(document.activeElement) ? document.activeElement : null;
  const selector = focused?.className ? `.${focused.className.split(" ")[0]}` : null;
  const caret =
    focused && "selectionStart" in focused ? [focused.selectionStart, focused.selectionEnd] : null;
  el.replaceChildren(...children);
  const again = selector ? el.querySelector(selector) : null;
  if (again) {
    again.focus();
    if (caret) again.setSelectionRange(...caret);
  }
}

function answerable(item) {
  if (item.answering) return false;
  const live = lives.get(view.sessionId);
  if (live?.consents.has(item.id)) return true;
  if (item.status === "pending" || item.status === "sent") return true;
  // Acknowledged over this tab's session before a reload: nobody works on it any more.
  return (
    item.status === "executing" && !item.owner && Boolean(live) && !live.client.isHandling(item.id)
  );
}

async function answerTool(item, allowed) {
  item.answering = true;
  item.status = allowed ? "executing" : "rejected";
  scheduleRender(item);
  const live = lives.get(view.sessionId);
  const resolve = live?.consents.get(item.id);
  if (resolve) {
    live.consents.delete(item.id);
    resolve(allowed); // the SessionClient acks, runs and answers (or nacks) over /v1/session
    return;
  }
  if (live && live.status === "open") {
    // Known from the archive (the frame was handled before a reload): same flow, same channel.
    live.preAnswers.set(item.id, allowed);
    live.client.handleToolCall({ id: item.id, name: item.name, arguments: item.args ?? {} });
    return;
  }
  try {
    if (!allowed) {
      await rpc.rtcUpdateStatus(item.id, "rejected", {
        clientId: TAB_ID,
        reason: DECLINED_BY_USER,
      });
      return;
    }
    await rpc.rtcUpdateStatus(item.id, "executing", { clientId: TAB_ID });
    let outcome;
    try {
      outcome = { success: true, result: await runTool(item.name, item.args, item.id) };
    } catch (error) {
      outcome = { success: false, error: error.message };
    }
    await rpc.rtcSubmitResult(item.id, { ...outcome, clientId: TAB_ID });
  } catch (error) {
    showNotice(`Could not answer the tool call: ${error.message}`);
  }
}

const mediaUrls = new Map(); // storage_ref -> Promise<object URL>

function mediaUrl(media) {
  if (media.data) return Promise.resolve(`data:${media.mime_type};base64,${media.data}`);
  if (media.storage_ref) {
    if (!mediaUrls.has(media.storage_ref)) {
      const url = fetchMedia(media.storage_ref, { token }).then((blob) =>
        URL.createObjectURL(blob),
      );
      url.catch(() => mediaUrls.delete(media.storage_ref));
      mediaUrls.set(media.storage_ref, url);
    }
    return mediaUrls.get(media.storage_ref);
  }
  return Promise.resolve(null);
}

function renderParts(parts, localUrls = null) {
  const box = h("div", { class: "parts" });
  parts.forEach((part, index) => {
    if (part.type === "text") {
      if (part.text) box.append(h("div", { class: "markdown" }, renderMarkdown(part.text)));
      return;
    }
    const media = part.media ?? {};
    const label = media.filename ?? `${part.type} (${media.mime_type ?? "?"})`;
    let node;
    if (part.type === "image") {
      node = h("img", { class: "media", alt: label, title: label });
      node.addEventListener("load", () => keepInView(node), { once: true });
    }
    else if (part.type === "audio")
      node = h("audio", { class: "media", controls: true, title: label });
    else if (part.type === "video")
      node = h("video", { class: "media", controls: true, title: label });
    else node = h("a", { class: "file", text: `⇩ ${label}`, download: media.filename ?? "file" });
    const local = localUrls?.[index];
    const source = local ? Promise.resolve(local) : mediaUrl(media);
    source.then(
      (url) => {
        if (!url) return;
        if (node.tagName === "A") node.href = url;
        else node.src = url;
      },
      () => node.replaceWith(h("span", { class: "file", text: `${label} (unavailable)` })),
    );
    box.append(
      h(
        "figure",
        { dataset: { type: part.type } },
        node,
        part.type === "file" ? null : h("figcaption", { text: label }),
      ),
    );
  });
  return box;
}

function renderHeader() {
  const session = view.sessionId ? sidebar.sessions.get(view.sessionId) : null;
  const title = view.sessionId ? session?.title || "Untitled conversation" : "New conversation";
  $("title").textContent = title;
  document.title = `${title} · Portico`;
  const mode = $("mode");
  if (!view.sessionId) {
    mode.textContent = "";
    mode.dataset.mode = "new";
  } else if (lives.has(view.sessionId)) {
    mode.textContent = "live · /v1/session";
    mode.dataset.mode = "live";
    mode.title =
      "This tab holds the conversation's resumable session: exactly-once streaming, tool consent, attachments.";
  } else {
    mode.textContent = "archive · /v1/rpc";
    mode.dataset.mode = "archive";
    mode.title =
      "Continued over RPC: messages go through v1.message.send and replies stream as live chunks.";
  }
  $("details-toggle").hidden = !view.sessionId;
  $("file").disabled = Boolean(view.sessionId) && !lives.has(view.sessionId);
  $("file").parentElement.title = $("file").disabled
    ? "Attachments need a live session: start a new conversation"
    : "Attach files";
}

// -- conversation details: the session's trace (v1.session.trace) ------------------------------

async function showDetails() {
  const sessionId = view.sessionId;
  if (!sessionId) return;
  const trace = $("trace");
  $("details").hidden = false;
  $("details-toggle").setAttribute("aria-expanded", "true");
  $("details-session").textContent = sessionId;
  trace.dataset.state = "loading";
  try {
    const { result } = await rpc.call("v1.session.trace", { session_id: sessionId });
    if (view.sessionId !== sessionId) return; // another conversation was opened meanwhile
    trace.replaceChildren(...result.items.map(traceEvent));
    $("trace-empty").hidden = result.items.length > 0;
    trace.dataset.state = "loaded";
  } catch (error) {
    if (view.sessionId !== sessionId) return;
    trace.dataset.state = "failed";
    showNotice(`Could not read the conversation's trace: ${error.message}`);
  }
}

function hideDetails() {
  $("details").hidden = true;
  $("details-toggle").setAttribute("aria-expanded", "false");
  $("trace").replaceChildren();
  $("trace").dataset.state = "idle";
}

function traceEvent(event) {
  const at = event.at ? new Date(event.at) : null;
  return h(
    "li",
    { class: "trace-event", dataset: { type: event.type } },
    h("time", { datetime: event.at ?? "", text: at ? at.toLocaleTimeString() : "" }),
    h("code", { class: "trace-type", text: event.type }),
    h("pre", { class: "trace-data", text: JSON.stringify(event.data, null, 1) }),
  );
}

function renderSidebar() {
  const list = $("sessions");
  const sessions = [...sidebar.sessions.values()].sort(
    (a, b) => (b.created_at ?? "").localeCompare(a.created_at ?? "") || b.id.localeCompare(a.id),
  );
  const wanted = new Set(sessions.map((s) => s.id));
  for (const [id, el] of sidebar.elements) {
    if (!wanted.has(id)) {
      el.remove();
      sidebar.elements.delete(id);
    }
  }
  sessions.forEach((session, index) => {
    let el = sidebar.elements.get(session.id);
    if (!el) {
      el = h("li", { dataset: { sessionId: session.id } });
      sidebar.elements.set(session.id, el);
    }
    if (sidebar.editing !== session.id) fillSessionItem(el, session);
    el.classList.toggle("current", session.id === view.sessionId);
    if (list.children[index] !== el) list.insertBefore(el, list.children[index] ?? null);
  });
  $("more-sessions").hidden = !sidebar.nextCursor;
}

// -- sidebar titles and activity ------------------------------------------------------------------

const TITLE_LENGTH = 60;
const titling = new Set(); // untitled sessions whose first message is being looked up
const lastActive = new Map(); // session id -> ISO time of its newest message seen here

/** A title from a conversation's first user message (what the page itself sets on send). */
const titleFrom = (text) => text.replace(/\s+/g, " ").trim().slice(0, TITLE_LENGTH);

function messageText(message) {
  if (typeof message.content_data === "string") return message.content_data;
  const part = (message.parts ?? []).find((p) => p.type === "text" && p.text);
  return part?.text ?? message.parts?.[0]?.media?.filename ?? "";
}

/**
 * An untitled conversation (opened by `portico chat`, the SDK, another client) is titled
 * from its first user message, once, for every client: the title is saved with
 * v1.session.update and comes back as a session update.
 */
async function titleUntitled(session) {
  if (session.title || titling.has(session.id)) return;
  titling.add(session.id);
  try {
    const page = await rpc.messageList(session.id, { limit: 1 });
    const first = page.items[0];
    const title = first?.role === "user" ? titleFrom(messageText(first)) : "";
    if (!title) return titling.delete(session.id); // nothing said yet: try on its first message
    if (!sidebar.sessions.get(session.id)?.title) await rpc.sessionUpdate(session.id, { title });
  } catch {
    titling.delete(session.id);
  }
}

function noteActivity(message) {
  const known = lastActive.get(message.session_id) ?? "";
  if ((message.created_at ?? "") > known) lastActive.set(message.session_id, message.created_at);
  const session = sidebar.sessions.get(message.session_id);
  if (!session) return;
  if (!session.title && message.role === "user") titleUntitled(session);
  const el = sidebar.elements.get(session.id);
  if (el && sidebar.editing !== session.id) fillSessionItem(el, session);
}

/** "just now", "5 min ago", "3 h ago", "yesterday", then the date. */
function relativeTime(iso, nowMs = Date.now()) {
  const minutes = Math.floor((nowMs - Date.parse(iso)) / 60_000);
  if (!(minutes >= 1)) return "just now";
  if (minutes < 60) return `${minutes} min ago`;
  if (minutes < 24 * 60) return `${Math.floor(minutes / 60)} h ago`;
  if (minutes < 48 * 60) return "yesterday";
  return new Date(iso).toLocaleDateString(undefined, { day: "numeric", month: "short" });
}

function activeAt(session) {
  const seen = lastActive.get(session.id) ?? "";
  const stored = session.updated_at ?? session.created_at ?? "";
  return seen > stored ? seen : stored;
}

function fillSessionItem(el, session) {
  if (!session.title) titleUntitled(session);
  const title = session.title || "Untitled conversation";
  const active = activeAt(session);
  const when = active
    ? h("time", {
        class: "session-active",
        datetime: active,
        title: `last active ${new Date(active).toLocaleString()}`,
        text: relativeTime(active),
      })
    : null;
  const confirming = sidebar.confirmDelete === session.id;
  const forked = session.parent_session_id
    ? h("span", { class: "forked", title: "forked from another conversation", text: "⑂" })
    : null;
  el.replaceChildren(
    ...[
      h("a", {
        class: "session-title",
        href: `#s=${encodeURIComponent(session.id)}`,
        title,
        text: title,
      }),
      forked,
      when,
      h("button", {
        type: "button",
        class: "rename",
        title: "Rename",
        "aria-label": "Rename",
        text: "✎",
        onclick: () => startRename(session.id),
      }),
      h("button", {
        type: "button",
        class: confirming ? "delete confirm" : "delete",
        title: confirming ? "Click again to delete" : "Delete",
        "aria-label": confirming ? "Confirm delete" : "Delete",
        text: confirming ? "Delete?" : "✕",
        onclick: () => deleteSession(session.id),
      }),
    ].filter(Boolean),
  );
}

function startRename(sessionId) {
  const el = sidebar.elements.get(sessionId);
  const session = sidebar.sessions.get(sessionId);
  if (!el || !session) return;
  sidebar.editing = sessionId;
  const input = h("input", {
    class: "rename-input",
    type: "text",
    maxlength: "256",
    "aria-label": "Conversation title",
  });
  input.value = session.title;
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    sidebar.editing = null;
    const title = input.value.trim();
    if (save && title && title !== session.title) {
      fillSessionItem(el, { ...session, title });
      try {
        await rpc.sessionUpdate(sessionId, { title });
      } catch (error) {
        showNotice(`Could not rename: ${error.message}`);
      }
    }
    renderSidebar();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
  el.replaceChildren(input);
  input.focus();
  input.select();
}

async function deleteSession(sessionId) {
  if (sidebar.confirmDelete !== sessionId) {
    sidebar.confirmDelete = sessionId;
    renderSidebar();
    setTimeout(() => {
      if (sidebar.confirmDelete === sessionId) {
        sidebar.confirmDelete = null;
        const session = sidebar.sessions.get(sessionId);
        const el = sidebar.elements.get(sessionId);
        if (session && el && sidebar.editing !== sessionId) fillSessionItem(el, session);
      }
    }, 4000);
    return;
  }
  sidebar.confirmDelete = null;
  try {
    await rpc.sessionUpdate(sessionId, { deletedAt: new Date() }); // the update removes it
  } catch (error) {
    showNotice(`Could not delete: ${error.message}`);
  }
}

// -- connection indicator -----------------------------------------------------------------

const connection = { rpc: "connecting", drops: 0 };

function renderConnection() {
  const live = lives.get(view.sessionId);
  const states = [connection.rpc, live?.status].filter(Boolean);
  let state = "open";
  if (states.includes("closed") && connection.rpc === "closed") state = "offline";
  else if (states.includes("dropped")) state = "reconnecting";
  else if (states.includes("connecting")) state = "connecting";
  const el = $("connection");
  el.dataset.state = state;
  el.dataset.reconnects = String(connection.drops);
  const labels = {
    open: "Connected",
    connecting: "Connecting…",
    reconnecting: "Reconnecting…",
    offline: "Offline",
  };
  const drops = connection.drops
    ? ` · ${connection.drops} reconnect${connection.drops === 1 ? "" : "s"}`
    : "";
  el.querySelector(".label").textContent = labels[state] + (state === "open" ? drops : "");
  el.title = `/v1/rpc: ${connection.rpc}${live ? ` · /v1/session: ${live.status}` : ""}`;
}

function busy() {
  const live = lives.get(view.sessionId);
  return Boolean(live?.openTurns) || Boolean(runningTurns.get(view.sessionId)?.size);
}

function renderBusy() {
  const running = busy();
  $("stop").hidden = !running;
  $("send").disabled =
    running || Boolean(voice) || view.attachments.some((a) => a.status === "uploading");
  renderConnection();
}

// -- voice: the microphone button (docs/web.md, "Voice") ------------------------------------------

// A call runs on a /ws connection of its own, so it is a conversation of its own: the view
// shows it live from the call's frames and, once it ends, from the archive.
const VOICE_LABELS = {
  starting: "Starting… allow the microphone",
  listening: "Listening: speak now",
  speaking: "Agent speaking: talk to interrupt",
  reconnecting: "Reconnecting the call…",
  ended: "Call ended",
  failed: "Call failed",
};
const voiceView = { user: null, reply: null, count: 0, timer: null };

async function startVoice() {
  if (voice) return;
  navigate(null);
  hideNotice();
  const path = AGENT ? `/ws?agent=${encodeURIComponent(AGENT)}` : "/ws";
  const call = new VoiceConversation(path, { token });
  voice = call;
  Object.assign(voiceView, { user: null, reply: null, count: 0 });
  call.addEventListener("state", (e) => renderVoice(call, e.detail));
  call.addEventListener("transcript", (e) => voiceHeard(e.detail.text));
  call.addEventListener("text", (e) => voiceSaid(e.detail.text));
  call.addEventListener("done", (e) => voiceDone(e.detail.text));
  call.addEventListener("interrupt", () => voiceInterrupted());
  $("title").textContent = "Voice conversation";
  $("input").disabled = true;
  $("input").placeholder = "A voice call is on: end it to type";
  renderBusy();
  voiceView.timer = setInterval(() => renderVoiceStats(call), 250);
  try {
    await call.start();
  } catch (error) {
    const denied = ["NotAllowedError", "NotFoundError", "NotSupportedError"].includes(error.name);
    showNotice(
      denied
        ? `The microphone is not available: ${error.message}`
        : `Could not start the voice conversation: ${error.message}`,
    );
  }
}

function renderVoice(call, { state, error }) {
  const bar = $("voice");
  bar.hidden = false;
  bar.dataset.state = state;
  bar.dataset.session = call.sessionId ?? "";
  let label = VOICE_LABELS[state] ?? state;
  if (state === "failed" && error?.message) label += `: ${error.message}`;
  $("voice-status").textContent = label;
  const live = state !== "ended" && state !== "failed";
  $("voice-stop").hidden = !live;
  $("mic").setAttribute("aria-pressed", String(live));
  $("mic").setAttribute("aria-label", live ? "End the voice conversation" : "Start a voice conversation");
  renderVoiceStats(call);
  if (!live) endVoice(call);
}

function renderVoiceStats(call) {
  const bar = $("voice");
  bar.dataset.playedSamples = String(call.player?.playedSamples ?? 0);
  bar.dataset.cutSamples = String(call.player?.cutSamples ?? 0);
  bar.dataset.interrupts = String(call.interrupts);
  bar.dataset.resumes = String(call.resumes);
}

function endVoice(call) {
  if (voice !== call) return;
  voice = null;
  clearInterval(voiceView.timer);
  if (voiceView.reply?.status === "streaming") voiceInterrupted();
  $("input").disabled = false;
  placeholder();
  renderBusy();
  // What was said is archived turn by turn: show that conversation from now on.
  if (voiceView.count && call.sessionId && !leavingVoice) navigate(call.sessionId);
}

function voiceItem(kind) {
  voiceView.count += 1;
  const item = newItem(`v:${voiceView.count}`, kind);
  item.el.dataset.source = "voice";
  return item;
}

function voiceHeard(text) {
  if (!text) return;
  const item = voiceView.user ?? (voiceView.user = voiceItem("user"));
  Object.assign(item, { text: item.text ? `${item.text} ${text}` : text, status: "sent" });
  voiceView.reply = null;
  scheduleRender(item);
}

function voiceSaid(text) {
  const item = voiceView.reply ?? (voiceView.reply = voiceItem("reply"));
  item.text = (item.text ?? "") + text;
  item.status = "streaming";
  voiceView.user = null;
  scheduleRender(item);
}

function voiceDone(text) {
  const item = voiceView.reply ?? voiceItem("reply");
  item.final = text || item.text || "";
  item.status = "completed";
  voiceView.reply = voiceView.user = null;
  scheduleRender(item);
}

function voiceInterrupted() {
  const item = voiceView.reply;
  if (!item) return;
  Object.assign(item, { cancelled: true, status: "completed", final: item.text ?? "" });
  voiceView.reply = null;
  scheduleRender(item);
}

// -- composer -----------------------------------------------------------------------------------

async function send() {
  const input = $("input");
  const text = input.value.trim();
  const ready = view.attachments.filter((a) => a.status === "ready");
  if ((!text && !ready.length) || busy()) return;
  const cmid = crypto.randomUUID();
  let live = lives.get(view.sessionId);
  try {
    if (!view.sessionId) live = await openLive();
  } catch (error) {
    showNotice(`Could not open a session: ${error.message}`);
    return;
  }
  const sessionId = view.sessionId;
  const first = ![...view.items.values()].some((item) => item.kind === "user");
  const item = newItem(`u:${cmid}`, "user");
  Object.assign(item, {
    text,
    status: "sending",
    parts: ready.map((a) => a.part),
    localUrls: ready.map((a) => a.localUrl),
  });
  render(item);
  input.value = "";
  resizeInput();
  view.attachments = [];
  renderAttachments();
  scrollToBottom();
  if (first && !sidebar.sessions.get(sessionId)?.title) {
    const title = (text || ready[0]?.file.name || "Attachment").replace(/\s+/g, " ").slice(0, 60);
    rpc.sessionUpdate(sessionId, { title }).catch(() => {});
  }
  if (live) {
    sendLive(live, item, { text, cmid, sessionId });
    return;
  }
  try {
    await rpc.messageSend(text || "(attachment)", { clientId: cmid, serverSessionId: sessionId });
  } catch (error) {
    item.status = "failed";
    item.error = error.message;
    render(item);
  }
}

/** Send over the live session. After a server restart the client sends a line nothing
 * answered yet again, with its key: one the old server had is answered DUPLICATE_MESSAGE. */
function sendLive(live, item, { text, cmid, sessionId }) {
  try {
    // The page's message id is its key too: sent again, the server never takes it twice.
    const turn = live.client.startTurn(text || null, {
      parts: item.parts.length ? item.parts : null,
      metadata: { client_message_id: cmid },
      clientId: cmid,
    });
    live.openTurns += 1;
    renderBusy();
    turn
      .reply()
      .then((reply) => {
        const refusal = reply.frames.find((f) => f.type === "error" && f.turn_id == null);
        if (reply.duplicate) {
          showDuplicate(item, reply.duplicate, sessionId);
        } else if (refusal && view.sessionId === sessionId) {
          item.status = "failed";
          item.error = refusal.error.message;
          render(item);
        }
      })
      .catch(() => {})
      .finally(() => {
        live.openTurns -= 1;
        renderBusy();
      });
  } catch (error) {
    item.status = "failed";
    item.error = error.message;
    render(item);
  }
}

/** The server already had this line (a restart hid its answer): the archive's copy of
 * it and of its reply stand; show that reply if the history has not yet. */
function showDuplicate(item, duplicate, sessionId) {
  if (view.sessionId !== sessionId) return;
  item.status = "sent";
  render(item);
  if (!duplicate.turn_id || duplicate.reply == null) return;
  later(() => {
    const reply = replyItem(duplicate.turn_id, null, 0);
    if (reply.status === "completed") return;
    reply.final = duplicate.reply;
    reply.status = "completed";
    scheduleRender(reply);
  });
}

async function stop() {
  const live = lives.get(view.sessionId);
  try {
    if (live?.openTurns) live.client.interrupt();
    else await rpc.turnStop(view.sessionId);
  } catch (error) {
    showNotice(`Could not stop: ${error.message}`);
  }
}

async function addAttachments(files) {
  if (!files.length) return;
  if (view.sessionId && !lives.has(view.sessionId)) {
    showNotice("Attachments need a live session: start a new conversation to attach files.");
    return;
  }
  try {
    if (!view.sessionId) await openLive();
  } catch (error) {
    showNotice(`Could not open a session: ${error.message}`);
    return;
  }
  const sessionId = view.sessionId;
  for (const file of files) {
    const attachment = {
      file,
      status: "uploading",
      localUrl: partType(file.type) === "file" ? null : URL.createObjectURL(file),
      part: null,
    };
    view.attachments.push(attachment);
    renderAttachments();
    uploadFile(file, { sessionId, token })
      .then((part) => {
        attachment.part = part;
        attachment.status = "ready";
      })
      .catch((error) => {
        attachment.status = "failed";
        attachment.error = error.message;
      })
      .finally(renderAttachments);
  }
}

function clearAttachments() {
  view.attachments = [];
  renderAttachments();
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(
    ...view.attachments.map((attachment) => {
      const remove = () => {
        view.attachments = view.attachments.filter((a) => a !== attachment);
        renderAttachments();
      };
      const preview =
        attachment.localUrl && attachment.file.type.startsWith("image/")
          ? h("img", { src: attachment.localUrl, alt: attachment.file.name })
          : h("span", { class: "icon", text: "▤" });
      const status =
        attachment.status === "failed" ? `failed: ${attachment.error}` : attachment.status;
      return h(
        "div",
        { class: "attachment", dataset: { status: attachment.status } },
        preview,
        h("span", { class: "name", text: attachment.file.name }),
        h("span", { class: "status", text: status }),
        h("button", {
          type: "button",
          class: "remove",
          "aria-label": `Remove ${attachment.file.name}`,
          text: "×",
          onclick: remove,
        }),
      );
    }),
  );
  renderBusy();
}

function resizeInput() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 200)}px`;
}

/**
 * An image grew the list after it was scrolled to the bottom: if the reader was at the
 * bottom before it loaded (a new reply, not history above), bring all of it into view.
 */
function keepInView(node) {
  const list = $("messages");
  const below = list.scrollHeight - list.scrollTop - list.clientHeight;
  if (below - node.offsetHeight < 80) list.scrollTop = list.scrollHeight;
}

function scrollToBottom() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function showNotice(text) {
  const notice = $("notice");
  delete notice.dataset.kind;
  notice.textContent = text;
  notice.hidden = false;
}

/** Authentication is on and the key is missing or wrong: say where it goes, and open it. */
function showAuthHint() {
  showNotice(
    token
      ? "The server refused this API key. Enter another under Settings → API token (in the sidebar), then Save and reconnect."
      : "This server needs an API key. Enter it under Settings → API token (in the sidebar), then Save and reconnect.",
  );
  $("notice").dataset.kind = "auth";
  document.querySelector(".settings").open = true;
  $("token").focus();
}

function hideNotice() {
  $("notice").hidden = true;
}

// -- wiring -------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
$("input").addEventListener("input", resizeInput);
// The long placeholder wraps to three lines in a phone's message box.
const narrow = matchMedia("(max-width: 480px)");
const placeholder = () => {
  $("input").placeholder = narrow.matches
    ? "Message the agent"
    : "Message the agent (Enter sends, Shift+Enter for a new line)";
};
narrow.addEventListener("change", placeholder);
placeholder();
$("stop").addEventListener("click", stop);
$("mic").addEventListener("click", () => (voice ? voice.stop() : startVoice()));
$("voice-stop").addEventListener("click", () => voice?.stop());
$("new-chat").addEventListener("click", () => navigate(null));
$("more-sessions").addEventListener("click", () =>
  loadMoreSessions().catch((e) => showNotice(e.message)),
);
$("file").addEventListener("change", (event) => {
  addAttachments([...event.target.files]);
  event.target.value = "";
});
for (const button of document.querySelectorAll(".suggest")) {
  button.addEventListener("click", () => {
    $("input").value = button.textContent;
    send();
  });
}
$("token").value = token ?? "";
$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = $("token").value.trim();
  if (value) localStorage.setItem(TOKEN_KEY, value);
  else localStorage.removeItem(TOKEN_KEY);
  location.reload();
});

let dragDepth = 0;
const hasFiles = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
window.addEventListener("dragenter", (event) => {
  if (!hasFiles(event)) return;
  dragDepth += 1;
  $("drop").hidden = false;
});
window.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (!dragDepth) $("drop").hidden = true;
});
window.addEventListener("dragover", (event) => {
  if (hasFiles(event)) event.preventDefault();
});
window.addEventListener("drop", (event) => {
  event.preventDefault();
  dragDepth = 0;
  $("drop").hidden = true;
  addAttachments([...(event.dataTransfer?.files ?? [])]);
});
$("details-toggle").addEventListener("click", () =>
  $("details").hidden ? showDetails() : hideDetails(),
);
$("details-close").addEventListener("click", hideDetails);
window.addEventListener("popstate", () => select(hashSession()));
window.addEventListener("hashchange", () => {
  const id = hashSession();
  if (id !== view.sessionId) select(id);
});

renderSidebar();
setInterval(renderSidebar, 60_000); // "5 min ago" moves on
renderConnection();
rpc.connect().catch((error) =>
  error instanceof RpcAuthenticationError
    ? showAuthHint()
    : showNotice(`Could not connect to /v1/rpc: ${error.message}`),
);
select(hashSession());
