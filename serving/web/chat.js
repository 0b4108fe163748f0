// The chat page: talks to the server's OpenAI routes (v1/models, v1/chat/completions),
// streams replies over SSE and renders them as they arrive. No framework, no build step.
// Paths are relative so the page also works behind a reverse proxy under a prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "jaxinfer.apiKey";

const state = {
  history: [],          // [{role, content}] sent with every request: the conversation
  controller: null,     // AbortController of the reply being streamed
  apiKey: sessionStorage.getItem(KEY_STORE) || "",
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h["Authorization"] = "Bearer " + state.apiKey;
  return h;
}

function setStatus(text) { $("status").textContent = text || ""; }

async function errorText(resp) {
  // OpenAI shape {"error": {"message"}} or TGI shape {"error": "..."}
  try {
    const body = await resp.json();
    const e = body.error;
    return (typeof e === "string" ? e : e && e.message) || resp.statusText;
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

function needKey(message) {
  $("key-box").hidden = false;
  setStatus(message || "This server needs an API key.");
  $("api-key").focus();
}

async function loadModels() {
  let resp;
  try {
    resp = await fetch("v1/models", { headers: headers() });
  } catch (e) {
    setStatus("Cannot reach the server: " + e.message);
    return;
  }
  if (resp.status === 401) { needKey(await errorText(resp)); return; }
  if (!resp.ok) { setStatus(await errorText(resp)); return; }
  const models = (await resp.json()).data.map((m) => m.id);
  const select = $("model");
  select.replaceChildren(...models.map((id) => new Option(id, id)));
  setStatus(models.length ? "" : "The server lists no models yet (still loading?).");
  $("send").disabled = !models.length;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const span = document.createElement("span");
  span.className = "text";
  span.textContent = text;      // text only: model output is never parsed as HTML
  div.append(span);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function numberField(id, parse) {
  const v = parse($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  return {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature", parseFloat),
    top_p: numberField("top-p", parseFloat),
    max_tokens: numberField("max-tokens", (s) => parseInt(s, 10)),
  };
}

// Parses a server-sent-event stream into the JSON of each `data:` line.
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function showStats(div, s) {
  const parts = [];
  if (s.ttft !== null) parts.push("TTFT " + s.ttft.toFixed(2) + " s");
  const decodeSeconds = (s.end - s.firstAt) / 1000;
  if (s.tokens > 1 && decodeSeconds > 0) {
    parts.push(((s.tokens - 1) / decodeSeconds).toFixed(1) + " tokens/s");
  }
  parts.push(s.tokens + " tokens");
  if (s.finish) parts.push(s.finish === "abort" ? "stopped" : "finish: " + s.finish);
  let stats = div.querySelector(".stats");
  if (!stats) {
    stats = document.createElement("span");
    stats.className = "stats";
    div.append(stats);
  }
  stats.textContent = parts.join(" · ");
}

async function streamReply(div, body, controller) {
  const text = div.querySelector(".text");
  const s = { start: performance.now(), firstAt: null, ttft: null, end: null, tokens: 0, finish: null };
  const resp = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
  });
  if (resp.status === 401) {
    needKey(await errorText(resp));
    throw new Error("the server needs an API key");
  }
  if (!resp.ok) throw new Error(await errorText(resp));
  try {
    for await (const chunk of sseEvents(resp.body)) {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.usage) s.tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (piece) {
          if (s.firstAt === null) {
            s.firstAt = performance.now();
            s.ttft = (s.firstAt - s.start) / 1000;
          }
          text.textContent += piece;
          if (!chunk.usage) s.tokens += 1;    // one chunk per token until usage says
          div.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) s.finish = choice.finish_reason;
      }
      s.end = performance.now();
      showStats(div, s);
    }
  } catch (e) {
    if (e.name !== "AbortError") throw e;
    s.finish = "abort";
  }
  s.end = performance.now();
  showStats(div, s);
  return text.textContent;
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || state.controller) return;
  $("prompt").value = "";
  setStatus("");
  state.history.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const controller = new AbortController();
  state.controller = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const reply = await streamReply(div, requestBody(), controller);
    state.history.push({ role: "assistant", content: reply });
  } catch (e) {
    div.remove();
    state.history.pop();    // the turn failed: it is not part of the conversation
    addMessage("error", e.name === "AbortError" ? "Stopped before the first token." : e.message);
  } finally {
    div.classList.remove("streaming");
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

// Aborting the fetch closes the connection; the server notices and aborts the request,
// which frees its KV cache pages.
function stop() {
  if (state.controller) state.controller.abort();
}

function init() {
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    stop();
    state.history = [];
    $("messages").replaceChildren();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("key-save").addEventListener("click", () => {
    state.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORE, state.apiKey);
    loadModels();
  });
  $("send").disabled = true;
  loadModels();
}

init();
