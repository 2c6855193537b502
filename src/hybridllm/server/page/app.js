// hybridllm's page: chat through /v1/chat/completions (streamed), and the live view of /stats.
// Plain JavaScript, no library, no request outside this origin.
"use strict";

const STATS_INTERVAL_MS = 1000;
const HISTORY_WINDOW_S = 300;
const KEY_STORAGE = "hybridllm.apiKey";

const $ = (id) => document.getElementById(id);

// ---- reading untrusted JSON: every field may be missing or of the wrong type -----------------
function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}
function pick(obj, ...path) {
  for (const key of path) {
    if (obj === null || typeof obj !== "object") return undefined;
    obj = obj[key];
  }
  return obj;
}
function text(value) {
  return typeof value === "string" ? value : value === null || value === undefined ? "" : String(value);
}
function formatBytes(value) {
  const n = num(value);
  if (n === null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Math.abs(n), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  const digits = i === 0 ? 0 : v < 10 ? 2 : v < 100 ? 1 : 0;
  return `${n < 0 ? "-" : ""}${v.toFixed(digits)} ${units[i]}`;
}
function formatRate(value, unit) {
  const n = num(value);
  return n === null ? "—" : `${n < 10 ? n.toFixed(1) : Math.round(n)} ${unit}`;
}
function formatCount(value) {
  const n = num(value);
  return n === null ? "—" : Math.round(n).toLocaleString("en-US");
}

// ---- the API key ------------------------------------------------------------------------------
const auth = {
  key: null,
  load() {
    try { this.key = window.localStorage.getItem(KEY_STORAGE); } catch (err) { this.key = null; }
  },
  save(key) {
    this.key = key || null;
    try {
      if (this.key) window.localStorage.setItem(KEY_STORAGE, this.key);
      else window.localStorage.removeItem(KEY_STORAGE);
    } catch (err) { /* storage off: the key lasts as long as the page */ }
  },
  headers() {
    const headers = { "Content-Type": "application/json" };
    if (this.key) headers.Authorization = `Bearer ${this.key}`;
    return headers;
  },
};

function showAuthBanner(message) {
  $("auth-message").textContent = message;
  $("auth-banner").hidden = false;
  $("key-button").hidden = false;
  $("api-key-input").focus();
}
function hideAuthBanner() {
  $("auth-banner").hidden = true;
}

// An HTTP error answer as one line: "401 Unauthorized: <the server's message>".
async function errorLine(response) {
  let message = "";
  try {
    const body = await response.json();
    message = text(pick(body, "error", "message"));
  } catch (err) { /* not JSON */ }
  const status = `${response.status} ${response.statusText || ""}`.trim();
  return message ? `${status}: ${message}` : status;
}

// ---- the model --------------------------------------------------------------------------------
// messages: the conversation sent with each request; generation: bumped by New chat, so an answer
// still streaming from the old conversation does not join the new one
const chatState = { model: null, messages: [], busy: false, controller: null, generation: 0 };

async function loadModel() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: auth.headers() });
  } catch (err) {
    $("model-name").textContent = "server unreachable";
    return false;
  }
  if (response.status === 401) {
    showAuthBanner(`${await errorLine(response)} — this server needs an API key. Enter it below (asked once, kept in this browser).`);
    $("model-name").textContent = "API key needed";
    return false;
  }
  if (!response.ok) {
    $("model-name").textContent = await errorLine(response);
    return false;
  }
  try {
    const body = await response.json();
    chatState.model = text(pick(body, "data", 0, "id")) || null;
  } catch (err) {
    chatState.model = null;
  }
  $("model-name").textContent = chatState.model || "unknown model";
  hideAuthBanner();
  return chatState.model !== null;
}

// ---- the conversation -------------------------------------------------------------------------
function addBubble(role, content) {
  const hint = $("empty-hint");
  if (hint) hint.remove();
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = role === "assistant" ? "answer-text" : "user-text";
  body.textContent = content;
  bubble.appendChild(body);
  if (role === "assistant") {
    const metrics = document.createElement("div");
    metrics.className = "answer-metrics";
    bubble.appendChild(metrics);
  }
  $("conversation").appendChild(bubble);
  scrollConversation();
  return bubble;
}
function scrollConversation() {
  const box = $("conversation");
  box.scrollTop = box.scrollHeight;
}
function setBusy(busy) {
  chatState.busy = busy;
  $("send-button").disabled = busy;
  $("stop-button").disabled = !busy;
}

function answerMetrics(bubble, run) {
  const parts = [];
  if (run.firstAt !== null) parts.push(`TTFT ${Math.round(run.firstAt - run.startedAt)} ms`);
  const tokens = run.completionTokens !== null ? run.completionTokens : run.chunks;
  if (run.firstAt !== null && run.lastAt !== null && tokens > 1 && run.lastAt > run.firstAt) {
    parts.push(`${((tokens - 1) * 1000 / (run.lastAt - run.firstAt)).toFixed(1)} tok/s`);
  }
  parts.push(`${tokens} tokens`);
  if (run.cachedTokens !== null) {
    parts.push(`cached prompt tokens ${run.cachedTokens}${run.promptTokens !== null ? ` of ${run.promptTokens}` : ""}`);
  } else {
    parts.push("cached prompt tokens —");
  }
  const line = bubble.querySelector(".answer-metrics");
  line.textContent = parts.join(" · ");
  line.dataset.ttftMs = run.firstAt !== null ? String(Math.round(run.firstAt - run.startedAt)) : "";
  line.dataset.cachedTokens = run.cachedTokens !== null ? String(run.cachedTokens) : "";
  if (run.stopped) {
    const stopped = document.createElement("span");
    stopped.className = "stopped";
    stopped.textContent = " · stopped";
    line.appendChild(stopped);
  }
}

// The SSE events of a streamed answer: each "data: {...}" payload, until "[DONE]".
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        try { yield JSON.parse(data); } catch (err) { /* a malformed event is skipped */ }
      }
    }
  }
}

function requestMessages(userText) {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  return messages.concat(chatState.messages, [{ role: "user", content: userText }]);
}
function sampling() {
  const body = {};
  const temperature = parseFloat($("temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function send() {
  const input = $("message-input");
  const userText = input.value.trim();
  if (!userText || chatState.busy) return;
  if (chatState.model === null && !(await loadModel())) {
    const bubble = addBubble("user", userText);
    bubble.classList.add("failed");
    const answer = addBubble("assistant", "");
    answer.classList.add("error");
    answer.querySelector(".answer-text").textContent = $("auth-banner").hidden
      ? "the model list could not be read" : $("auth-message").textContent;
    return;
  }
  input.value = "";
  const userBubble = addBubble("user", userText);
  const bubble = addBubble("assistant", "");
  const answerText = bubble.querySelector(".answer-text");
  const run = { startedAt: performance.now(), firstAt: null, lastAt: null, chunks: 0, completionTokens: null,
                promptTokens: null, cachedTokens: null, stopped: false };
  const controller = new AbortController();
  const generation = chatState.generation;
  chatState.controller = controller;
  setBusy(true);
  bubble.classList.add("streaming");
  let reply = "";
  let failed = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: auth.headers(),
      body: JSON.stringify({ model: chatState.model, messages: requestMessages(userText), stream: true,
                             stream_options: { include_usage: true }, ...sampling() }),
      signal: controller.signal,
    });
    if (!response.ok) {
      failed = await errorLine(response);
      if (response.status === 401) showAuthBanner(`${failed} — enter the server's API key below.`);
    } else {
      for await (const event of sseEvents(response)) {
        const error = pick(event, "error", "message");
        if (error !== undefined) { failed = text(error); break; }
        const delta = pick(event, "choices", 0, "delta", "content");
        if (typeof delta === "string" && delta.length) {
          const now = performance.now();
          if (run.firstAt === null) run.firstAt = now;
          run.lastAt = now;
          run.chunks += 1;
          reply += delta;
          answerText.textContent = reply;
          scrollConversation();
        }
        const usage = pick(event, "usage");
        if (usage && typeof usage === "object") {
          run.completionTokens = num(usage.completion_tokens);
          run.promptTokens = num(usage.prompt_tokens);
          run.cachedTokens = num(pick(usage, "prompt_tokens_details", "cached_tokens"));
        }
      }
    }
  } catch (err) {
    if (err && err.name === "AbortError") run.stopped = true;
    else failed = `the request failed: ${text(err && err.message)}`;
  } finally {
    chatState.controller = null;
    setBusy(false);
    bubble.classList.remove("streaming");
  }
  if (failed !== null) {
    bubble.classList.add("error");
    answerText.textContent = reply ? `${reply}\n\n${failed}` : failed;
    userBubble.classList.add("failed");
    return;
  }
  if (generation === chatState.generation && reply) {  // a stop before the first token adds no turn
    chatState.messages.push({ role: "user", content: userText }, { role: "assistant", content: reply });
  }
  answerMetrics(bubble, run);
  bubble.classList.add("done");
}

function stop() {
  if (chatState.controller) chatState.controller.abort();
}

function newChat() {
  stop();
  chatState.generation += 1;
  chatState.messages = [];
  $("conversation").textContent = "";
}

// ---- the live view ----------------------------------------------------------------------------
const histories = new Map(); // replica key -> [{t, decode_tokens_per_s, bus_bytes_per_s, kv_bytes}, ...]

// /stats?since=: the oldest of the replicas' newest samples (each replica has its own clock);
// none while a replica shown has no history yet
function sinceParam() {
  const cards = [...$("replicas").children];
  let since = null;
  for (const card of cards) {
    const history = histories.get(card.dataset.replica) || [];
    if (!history.length) return null;
    const t = history[history.length - 1].t;
    since = since === null ? t : Math.min(since, t);
  }
  return since;
}

function setField(card, name, value, bytes) {
  const el = card.querySelector(`[data-field="${name}"]`);
  if (!el) return;
  el.textContent = value;
  if (bytes !== undefined) el.dataset.bytes = num(bytes) === null ? "" : String(bytes);
}

function replicaCard(key) {
  const box = $("replicas");
  let card = box.querySelector(`[data-replica="${CSS.escape(key)}"]`);
  if (!card) {
    card = $("replica-template").content.firstElementChild.cloneNode(true);
    card.dataset.replica = key;
    box.appendChild(card);
  }
  return card;
}

function renderBar(card, tier, parts, capacity) {
  const bar = card.querySelector(`[data-field="${tier}-bar"]`);
  if (!bar) return;
  bar.textContent = "";
  const total = num(capacity);
  for (const [cls, value] of parts) {
    const n = num(value);
    if (n === null || n <= 0 || total === null || total <= 0) continue;
    const span = document.createElement("span");
    span.className = cls;
    span.style.width = `${Math.max(0.5, Math.min(100, (n / total) * 100))}%`;
    span.title = `${cls}: ${formatBytes(n)}`;
    bar.appendChild(span);
  }
}

function renderMemory(card, stats) {
  const memory = pick(stats, "memory") || {};
  for (const tier of ["device", "host"]) {
    const m = memory[tier] || {};
    setField(card, `${tier}-weights`, formatBytes(m.weights), m.weights);
    setField(card, `${tier}-kv`, formatBytes(m.kv), m.kv);
    setField(card, `${tier}-prefix`, formatBytes(m.prefix_cache), m.prefix_cache);
    renderBar(card, tier, [["weights", m.weights], ["kv", m.kv], ["prefix", m.prefix_cache]], m.capacity);
    const notes = [];
    if (num(m.capacity) !== null) notes.push(`of ${formatBytes(m.capacity)}`);
    if (num(m.kv_budget) !== null) notes.push(`KV budget ${formatBytes(m.kv_budget)}`);
    if (tier === "device" && memory.device_is_host === true) notes.push("the CPU stands in: shares the host RAM");
    setField(card, `${tier}-note`, notes.join(" · "));
  }
  const disk = memory.disk || {};
  setField(card, "disk-prefix", formatBytes(disk.prefix_cache), disk.prefix_cache);
  renderBar(card, "disk", [["prefix", disk.prefix_cache]], disk.budget);
  setField(card, "disk-note", num(disk.budget) ? `budget ${formatBytes(disk.budget)}` : "no disk tier");
}

function renderNumbers(card, stats) {
  setField(card, "running", formatCount(pick(stats, "requests", "running")));
  setField(card, "waiting", formatCount(pick(stats, "requests", "waiting")));
  setField(card, "decode-rate", formatRate(pick(stats, "decode", "tokens_per_s"), "tok/s"));
  const bus = num(pick(stats, "bus", "bytes_per_s"));
  setField(card, "bus-rate", bus === null ? "—" : `${formatBytes(bus)}/s`);
  setField(card, "kv-pages", `${formatCount(pick(stats, "kv", "pages", "device"))} / ${formatCount(pick(stats, "kv", "pages", "host"))}`);
  const prefix = pick(stats, "prefix_cache");
  if (prefix === null) {
    setField(card, "prefix-pages", "off");
    setField(card, "prefix-hit-rate", "off");
  } else {
    setField(card, "prefix-pages", `${formatCount(pick(prefix, "pages", "host"))} / ${formatCount(pick(prefix, "pages", "disk"))}`);
    const rate = num(pick(prefix, "hit_rate"));
    setField(card, "prefix-hit-rate", rate === null ? "—" : `${(rate * 100).toFixed(1)}%`);
  }
  setField(card, "generated", formatCount(pick(stats, "decode", "generated_tokens")));
}

function renderFacts(card, stats, replica) {
  const placement = pick(stats, "placement") || {};
  const facts = [text(pick(stats, "model")), text(placement.device) && `device ${text(placement.device)}`,
                 text(placement.weights) && `weights ${text(placement.weights)}`,
                 text(pick(stats, "kv", "strategy")) && `KV ${text(pick(stats, "kv", "strategy"))}`,
                 num(pick(stats, "uptime_s")) !== null && `up ${Math.round(stats.uptime_s)} s`];
  setField(card, "facts", facts.filter(Boolean).join(" · "));
  const title = card.querySelector(".replica-title");
  if (replica) {
    const who = [text(replica.hostname), num(replica.pid) !== null ? `pid ${replica.pid}` : ""].filter(Boolean);
    title.textContent = `replica ${text(replica.replica)}${replica.live === false ? " (down)" : ""}${who.length ? ` · ${who.join(" ")}` : ""}`;
    card.classList.toggle("down", replica.live === false);
  } else {
    title.textContent = "";
  }
  title.hidden = !replica;
}

function sparkPath(svg, points, key) {
  if (!svg) return;
  svg.textContent = "";
  const values = points.map((p) => num(p[key])).filter((v) => v !== null);
  if (points.length < 2 || values.length < 2) return;
  const t1 = points[points.length - 1].t, t0 = t1 - HISTORY_WINDOW_S;
  const top = Math.max(...values) || 1;
  const coords = [];
  for (const p of points) {
    const v = num(p[key]);
    if (v === null) continue;
    const x = Math.max(0, ((p.t - t0) / HISTORY_WINDOW_S) * 300);
    coords.push(`${x.toFixed(1)},${(38 - (v / top) * 36).toFixed(1)}`);
  }
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", coords.join(" "));
  svg.appendChild(line);
  const title = document.createElementNS("http://www.w3.org/2000/svg", "title");
  title.textContent = `max ${key.includes("bytes") ? formatBytes(top) : top.toFixed(1)}`;
  svg.appendChild(title);
}

function renderHistory(card, key, stats) {
  const incoming = Array.isArray(pick(stats, "history")) ? stats.history : [];
  const history = histories.get(key) || [];
  for (const point of incoming) {
    const t = num(pick(point, "t"));
    if (t === null || (history.length && t <= history[history.length - 1].t)) continue;
    history.push(point);
  }
  while (history.length && history[0].t < history[history.length - 1].t - HISTORY_WINDOW_S) history.shift();
  histories.set(key, history);
  sparkPath(card.querySelector('[data-field="spark-decode"]'), history, "decode_tokens_per_s");
  sparkPath(card.querySelector('[data-field="spark-kv"]'), history, "kv_bytes");
  sparkPath(card.querySelector('[data-field="spark-bus"]'), history, "bus_bytes_per_s");
  const span = history.length > 1 ? history[history.length - 1].t - history[0].t : 0;
  setField(card, "spark-window", `last ${Math.round(span)} s of ${HISTORY_WINDOW_S} s`);
}

function renderPlacement(card, stats) {
  const placement = pick(stats, "placement") || {};
  const strip = card.querySelector('[data-field="layers"]');
  strip.textContent = "";
  const layers = Array.isArray(placement.layers) ? placement.layers : [];
  const cells = [["E", placement.embed, "token embedding"], ...layers.map((tier, i) => [String(i), tier, `layer ${i}`]),
                 ["H", placement.head, "output head"]];
  for (const [label, tier, name] of cells) {
    const cell = document.createElement("span");
    const known = tier === "device" || tier === "host";
    cell.className = `layer ${known ? tier : "unknown"}`;
    cell.textContent = label.length <= 2 ? label : "";
    cell.title = `${name}: ${known ? tier : "unknown"}`;
    cell.dataset.tier = known ? tier : "";
    strip.appendChild(cell);
  }
  const onDevice = layers.filter((t) => t === "device").length;
  const notes = [`${onDevice} of ${layers.length} layers on the device`];
  if (text(placement.decode_on)) notes.push(`decode on the ${text(placement.decode_on)}`);
  setField(card, "placement-note", notes.join(" · "));
  renderKvMaps(card, stats);
}

function renderKvMaps(card, stats) {
  const box = card.querySelector('[data-field="kv-maps"]');
  box.textContent = "";
  const sequences = Array.isArray(pick(stats, "sequences")) ? stats.sequences : [];
  const pageSize = num(pick(stats, "kv", "page_size")) || 1;
  if (!sequences.length) {
    const none = document.createElement("div");
    none.className = "kv-map-label";
    none.textContent = "no request running: no KV held";
    box.appendChild(none);
    return;
  }
  const styles = getComputedStyle(document.documentElement);
  const colors = { device: styles.getPropertyValue("--device").trim(), host: styles.getPropertyValue("--host").trim() };
  for (const seq of sequences.slice(0, 16)) {
    const tokens = Array.isArray(pick(seq, "tokens")) ? seq.tokens.map((v) => num(v) || 0) : [];
    const hostTokens = Array.isArray(pick(seq, "host_tokens")) ? seq.host_tokens.map((v) => num(v) || 0) : [];
    const pages = tokens.map((n) => Math.ceil(n / pageSize));
    const maxPages = Math.max(1, ...pages);
    const wrap = document.createElement("div");
    wrap.className = "kv-map";
    const label = document.createElement("div");
    label.className = "kv-map-label";
    const id = text(pick(seq, "id"));
    label.textContent = `${id.slice(-8) || "request"}${num(seq.index) ? ` #${seq.index}` : ""}: ${Math.max(0, ...tokens)} tokens, ${maxPages} page${maxPages === 1 ? "" : "s"} per layer`;
    wrap.appendChild(label);
    const cell = Math.max(2, Math.min(16, Math.floor(360 / maxPages)));
    const canvas = document.createElement("canvas");
    canvas.width = maxPages * cell;
    canvas.height = Math.max(1, tokens.length) * 3;
    const ctx = canvas.getContext("2d");
    tokens.forEach((n, layer) => {
      const hostPages = Math.ceil(Math.min(hostTokens[layer] || 0, n) / pageSize);
      for (let page = 0; page < pages[layer]; page += 1) {
        // per layer the count is exact; the order is drawn host first (a tiered cache keeps its
        // oldest pages on the host, but for the sink tokens; a host layer or cache holds all)
        ctx.fillStyle = page < hostPages ? colors.host : colors.device;
        ctx.fillRect(page * cell, layer * 3, cell - 1, 2);
      }
    });
    wrap.appendChild(canvas);
    box.appendChild(wrap);
  }
}

// Each section alone: a field that is missing or wrong blanks its section, never the page.
function renderStats(card, key, stats, replica) {
  const sections = [renderFacts, renderMemory, renderNumbers, renderPlacement];
  for (const section of sections) {
    try { section(card, stats, replica); } catch (err) { console.warn(`stats: ${section.name}: ${err}`); }
  }
  try { renderHistory(card, key, stats); } catch (err) { console.warn(`stats: history: ${err}`); }
}

async function refreshStats() {
  const status = $("stats-status");
  const errorBox = $("stats-error");
  try {
    const since = sinceParam();
    const url = since === null ? "/stats" : `/stats?since=${encodeURIComponent(since)}`;
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(await errorLine(response));
    const body = await response.json();
    const replicas = Array.isArray(pick(body, "replicas")) ? body.replicas : null;
    const entries = replicas
      ? replicas.map((r, i) => ({ key: `replica-${text(pick(r, "replica")) || i}`, stats: pick(r, "stats") || {}, replica: r || {} }))
      : [{ key: "server", stats: body || {}, replica: null }];
    const keep = new Set(entries.map((e) => e.key));
    for (const card of [...$("replicas").children]) if (!keep.has(card.dataset.replica)) card.remove();
    for (const entry of entries) renderStats(replicaCard(entry.key), entry.key, entry.stats, entry.replica);
    status.className = "stats-status status-live";
    status.title = "live view: updated every second";
    errorBox.hidden = true;
  } catch (err) {
    status.className = "stats-status status-down";
    errorBox.textContent = `live view: /stats unavailable (${text(err && err.message)}); retrying`;
    errorBox.hidden = false;
  } finally {
    window.setTimeout(refreshStats, STATS_INTERVAL_MS);
  }
}

// ---- wiring -------------------------------------------------------------------------------------
function start() {
  auth.load();
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("message-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("stop-button").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("auth-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    auth.save($("api-key-input").value.trim());
    $("api-key-input").value = "";
    await loadModel();
  });
  $("key-button").addEventListener("click", () => showAuthBanner("Enter the server's API key."));
  loadModel();
  refreshStats();
}

document.addEventListener("DOMContentLoaded", start);
