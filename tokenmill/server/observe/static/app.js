// tokenmill's page: a chat playground and a live view of the engines. No framework,
// no build step. The chat speaks the OpenAI API of this server (/v1/models,
// /v1/chat/completions, streamed); the live view reads /tokenmill/live/events
// (server-sent events; server/observe/live.py documents the shape). Memory stays bounded
// however long the page is open: the steps, requests and series kept are capped.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "tokenmill.chat.v1";
  const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "seed", "json-schema", "tools"];
  const STEPS_KEPT = 240;          // steps the Gantt can show
  const REQUESTS_KEPT = 200;       // requests followed (the oldest are forgotten first)
  const REQUESTS_SHOWN = 12;
  const HISTORY_KEPT = 16;         // a request's states (its first and the latest; preemptions can repeat)
  const WATCHDOG_MS = 4000;        // no event for this long: the stream is dead, reconnect
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue("--" + name).trim();

  // ------------------------------------------------------------------ tabs

  const TABS = { chat: ["tab-chat", "view-chat"], live: ["tab-live", "view-live"] };

  function showTab(name, focus) {
    for (const [key, [tab, view]] of Object.entries(TABS)) {
      const on = key === name;
      $(tab).setAttribute("aria-selected", String(on));
      $(tab).tabIndex = on ? 0 : -1;
      $(view).hidden = !on;
    }
    if (focus) $(TABS[name][0]).focus();
    if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
    watchOrNot();
    if (name === "live") scheduleDraw();
  }

  for (const [key, [tab]] of Object.entries(TABS)) {
    $(tab).addEventListener("click", () => showTab(key, false));
    $(tab).addEventListener("keydown", (e) => {
      if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
        e.preventDefault();
        showTab(key === "chat" ? "live" : "chat", true);
      }
    });
  }
  window.addEventListener("hashchange", () => showTab(location.hash === "#live" ? "live" : "chat", false));

  // ------------------------------------------------------------------ models

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", { credentials: "same-origin" });
    } catch (e) {
      setTimeout(loadModels, 2000);  // the server is restarting: try again
      return;
    }
    if (response.status === 401) { location.reload(); return; }
    if (!response.ok) { setTimeout(loadModels, 2000); return; }
    const cards = (await response.json()).data;
    const select = $("model");
    const previous = localStorage.getItem(STORE + ".model") || select.value;
    select.replaceChildren();
    for (const card of cards) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.router ? `${card.id} (router: ${card.router.small} or ${card.router.large})`
        : card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
      select.append(option);
    }
    if (cards.some((c) => c.id === previous)) select.value = previous;
  }
  $("model").addEventListener("change", () => localStorage.setItem(STORE + ".model", $("model").value));

  // ------------------------------------------------------------------ chat

  let conversation = [];
  let controller = null;  // the answer streaming now, if any

  function load() {
    try { conversation = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { conversation = []; }
    for (const m of conversation) if (m.state === "streaming") m.state = "stopped";
    let kept = {};
    try { kept = JSON.parse(localStorage.getItem(STORE + ".settings") || "{}"); } catch (e) { kept = {}; }
    for (const id of SETTINGS) if (typeof kept[id] === "string") $(id).value = kept[id];
    $("structured-details").open = $("json-schema").value.trim() !== "";  // a constraint in force is in sight
    $("tools-details").open = $("tools").value.trim() !== "";
  }

  function save() {
    try { localStorage.setItem(STORE, JSON.stringify(conversation.slice(-200))); } catch (e) { /* full: not kept */ }
  }

  function renderAll() {
    $("messages").replaceChildren(...conversation.map(messageItem));
  }

  function messageItem(m) {
    const li = document.createElement("li");
    li.className = "msg";
    li.dataset.role = m.role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = m.role === "user" ? "You" : (m.model || "assistant");
    const content = document.createElement("div");
    content.className = "content";
    li.append(who, content);
    updateItem(li, m);
    return li;
  }

  function updateItem(li, m) {
    li.dataset.state = m.state || "done";
    li.setAttribute("aria-busy", String(li.dataset.state === "streaming"));  // read out once whole
    li.querySelector(".content").textContent = m.error ? `${m.content ? m.content + "\n" : ""}Error: ${m.error}` : m.content;
    let calls = li.querySelector(".tool-calls");
    if (m.tool_calls && m.tool_calls.length) {
      if (!calls) { calls = document.createElement("pre"); calls.className = "tool-calls"; li.append(calls); }
      calls.textContent = "Tool calls:\n" + m.tool_calls.map((c) => `${c.function.name}(${c.function.arguments})`).join("\n");
    }
    let stats = li.querySelector(".stats");
    if (m.stats) {
      if (!stats) { stats = document.createElement("div"); stats.className = "stats"; li.append(stats); }
      stats.textContent = m.stats;
    }
  }

  function settings() {
    // The request's fields from the form; an Error naming the field when one is wrong.
    const number = (id, name, integer) => {
      const text = $(id).value.trim();
      if (text === "") return undefined;
      const value = Number(text);
      if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) throw new Error(`${name} must be a${integer ? "n integer" : " number"}`);
      return value;
    };
    const json = (id, name) => {
      const text = $(id).value.trim();
      if (!text) return undefined;
      try { return JSON.parse(text); } catch (e) { throw new Error(`${name} is not valid JSON: ${e.message}`); }
    };
    const body = { model: $("model").value, stream: true, stream_options: { include_usage: true } };
    const temperature = number("temperature", "Temperature"); if (temperature !== undefined) body.temperature = temperature;
    const topP = number("top-p", "Top p"); if (topP !== undefined) body.top_p = topP;
    const maxTokens = number("max-tokens", "Max tokens", true); if (maxTokens !== undefined) body.max_tokens = maxTokens;
    const seed = number("seed", "Seed", true); if (seed !== undefined) body.seed = seed;
    const schema = json("json-schema", "The JSON schema");
    if (schema !== undefined) body.response_format = { type: "json_schema", json_schema: { name: "answer", schema, strict: true } };
    const tools = json("tools", "The tool definition");
    if (tools !== undefined) body.tools = Array.isArray(tools) ? tools : [tools];
    return body;
  }

  function messagesToSend() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of conversation) {
      if (m.state === "error") continue;
      let content = m.content;
      if (m.tool_calls && m.tool_calls.length) {  // shown to the model as text: no tool results follow
        content += (content ? "\n" : "") + JSON.stringify(m.tool_calls.map((c) => c.function));
      }
      messages.push({ role: m.role, content });
    }
    return messages;
  }

  async function send() {
    if (controller) return;
    const text = $("prompt").value.trim();
    if (!text) return;
    let body;
    try {
      body = settings();
      $("settings-error").hidden = true;
    } catch (e) {
      $("settings-error").textContent = e.message;
      $("settings-error").hidden = false;
      return;
    }
    $("prompt").value = "";
    const user = { role: "user", content: text };
    conversation.push(user);
    $("messages").append(messageItem(user));
    body.messages = messagesToSend();
    const answer = { role: "assistant", content: "", state: "streaming", model: body.model };
    conversation.push(answer);
    const li = messageItem(answer);
    $("messages").append(li);
    li.scrollIntoView({ block: "end" });
    controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    const t0 = performance.now();
    let first = null, usage = null, chunks = 0, finish = null;
    const calls = [];
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal, credentials: "same-origin",
      });
      if (!response.ok) {
        const error = await response.json().catch(() => null);
        throw new Error((error && error.error && error.error.message) || `HTTP ${response.status}`);
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
            if (chunk.usage) usage = chunk.usage;
            const choice = chunk.choices && chunk.choices[0];
            if (!choice) continue;
            const delta = choice.delta || {};
            if (delta.content) {
              if (first === null) first = performance.now();
              answer.content += delta.content;
              chunks += 1;
            }
            for (const call of delta.tool_calls || []) {
              if (first === null) first = performance.now();
              const slot = calls[call.index] || (calls[call.index] = { function: { name: "", arguments: "" } });
              if (call.function && call.function.name) slot.function.name += call.function.name;
              if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
            }
            if (calls.length) answer.tool_calls = calls.filter(Boolean);
            if (choice.finish_reason) finish = choice.finish_reason;
          }
          updateItem(li, answer);
        }
      }
      answer.state = "done";
    } catch (e) {
      if (e.name === "AbortError") answer.state = "stopped";
      else { answer.state = "error"; answer.error = e.message; }
    } finally {
      const end = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      const parts = [`${usage ? "" : "~"}${tokens} token${tokens === 1 ? "" : "s"}`];
      if (usage) parts.push(`prompt ${usage.prompt_tokens}`);
      if (first !== null) parts.push(`TTFT ${Math.round(first - t0)} ms`);
      if (first !== null && tokens > 1 && end > first) parts.push(`${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tok/s`);
      if (finish) parts.push(`finish: ${finish}`);
      if (answer.state === "stopped") parts.push("stopped");
      answer.stats = parts.join(" · ");
      updateItem(li, answer);
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
      save();
    }
  }

  function stop() { if (controller) controller.abort(); }

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && controller) { e.preventDefault(); stop(); } });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { stop(); conversation = []; save(); renderAll(); $("prompt").focus(); });
  for (const id of SETTINGS) {  // kept in this browser, as the conversation is
    $(id).addEventListener("change", () => {
      localStorage.setItem(STORE + ".settings", JSON.stringify(Object.fromEntries(SETTINGS.map((k) => [k, $(k).value]))));
    });
  }

  // -------------------------------------------------------------- live view

  let source = null;      // the EventSource
  let lastEvent = 0;      // performance.now() of the last event
  let retryMs = 1000;
  let reconnectTimer = null;
  const live = { epoch: null, models: new Map(), selected: null, energy: null };

  function setStatus(state, text) {
    const el = $("conn-status");
    el.dataset.state = state;
    el.textContent = text;
  }

  function connect() {
    if ($("view-live").hidden || document.hidden) { reconnectTimer = null; watchOrNot(); return; }
    clearTimeout(reconnectTimer);
    reconnectTimer = null;
    if (source) source.close();
    setStatus("connecting", "connecting…");
    source = new EventSource("/tokenmill/live/events");
    lastEvent = performance.now();
    source.onopen = () => { retryMs = 1000; };
    source.addEventListener("state", (e) => {
      lastEvent = performance.now();
      setStatus("open", "live");
      onState(JSON.parse(e.data));
    });
    source.onerror = () => {
      setStatus("connecting", "reconnecting…");
      if (source.readyState === EventSource.CLOSED) scheduleReconnect();  // else the browser retries itself
    };
  }

  function scheduleReconnect() {
    if (reconnectTimer) return;
    fetch("/tokenmill/live?since=999999999", { credentials: "same-origin" })  // signed out: the page asks for the key
      .then((r) => { if (r.status === 401) location.reload(); }, () => {});
    setStatus("closed", `offline: retrying in ${Math.round(retryMs / 1000)} s`);
    reconnectTimer = setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  }

  setInterval(() => {  // a closed stream, or one that went silent (a server gone without a word)
    if (!source || reconnectTimer) return;
    if (source.readyState === EventSource.CLOSED || performance.now() - lastEvent > WATCHDOG_MS) {
      source.close();
      scheduleReconnect();
    }
  }, 1000);

  function watchOrNot() {
    // The stream is open only while the engine view is in sight: an unwatched tab costs the server nothing.
    const watching = !$("view-live").hidden && !document.hidden;
    if (watching && !source && !reconnectTimer) connect();
    if (!watching && (source || reconnectTimer)) {
      clearTimeout(reconnectTimer);
      reconnectTimer = null;
      if (source) source.close();
      source = null;
      setStatus("closed", "paused");
    }
  }
  document.addEventListener("visibilitychange", watchOrNot);

  window.tokenmill = {  // for the browser tests and the curious: the stream, and what the view keeps
    get liveSource() { return source; }, reconnect: connect, onState,
    kept: () => [...live.models.values()].map((d) => ({ name: d.name, steps: d.steps.length, requests: d.requests.size })),
  };

  function modelData(name) {
    let d = live.models.get(name);
    if (!d) {
      d = { name, info: null, steps: [], requests: new Map(), lastStep: 0 };
      live.models.set(name, d);
    }
    return d;
  }

  function onState(state) {
    if (state.epoch !== live.epoch) {  // a server started afresh: its steps start again at 1
      if (live.epoch !== null) loadModels();  // and it may serve other models
      live.epoch = state.epoch;
      live.models.clear();
    }
    live.energy = state.energy;
    const names = state.models.map((m) => m.name);
    for (const name of [...live.models.keys()]) if (!names.includes(name)) live.models.delete(name);
    for (const m of state.models) {
      const d = modelData(m.name);
      d.info = m;
      d.bucket = state.series_bucket_s;
      for (const step of m.steps) {
        if (step.step <= d.lastStep) continue;
        d.lastStep = step.step;
        d.steps.push(step);
        follow(d, step);
      }
      if (d.steps.length > STEPS_KEPT) d.steps.splice(0, d.steps.length - STEPS_KEPT);
      if (m.gauges.running === 0 && m.gauges.waiting === 0) {  // idle: nothing can still run (aborted ones end so)
        for (const r of d.requests.values()) if (r.state === "running" || r.state === "preempted") become(r, "ended");
      }
    }
    updateModelPicker(names);
    scheduleDraw();
  }

  // A request's state, and the states it passed through: one event carries every step
  // since the last, so a request that started and ended between two events is drawn only
  // finished, but its history still says that it ran.
  function become(r, state) {
    r.state = state;
    if (r.history[r.history.length - 1] !== state) r.history.push(state);
    if (r.history.length > HISTORY_KEPT) r.history.splice(1, 1);
  }

  function follow(d, step) {
    // What the table of recent requests shows, from each step's sequences.
    const touch = (label) => {
      let r = d.requests.get(label);
      if (r) d.requests.delete(label);  // re-inserted: the Map's order is recency
      else r = { label, state: null, history: [], prompt: 0, generated: 0, cached: 0, steps: 0, lora: null };
      d.requests.set(label, r);
      return r;
    };
    for (const [label, kind, tokens, , , cached, lora, finish] of step.seqs) {
      const r = touch(label);
      r.steps += 1;
      r.lora = lora;
      r.cached += cached;
      if (kind === "prefill") r.prompt += tokens; else r.generated += tokens;
      become(r, "running");  // it ran in this step (and may have ended with it)
      if (finish) become(r, "finished");
      r.finish = finish;
    }
    for (const label of step.preempted) become(touch(label), "preempted");
    for (const [label, reason] of step.ended || []) {  // ended between steps: aborted, a stop string
      const r = touch(label);
      become(r, "finished");
      r.finish = reason;
    }
    while (d.requests.size > REQUESTS_KEPT) d.requests.delete(d.requests.keys().next().value);
  }

  function updateModelPicker(names) {
    const select = $("live-model");
    const current = [...select.options].map((o) => o.value);
    if (current.join("\n") !== names.join("\n")) {
      select.replaceChildren(...names.map((n) => { const o = document.createElement("option"); o.value = o.textContent = n; return o; }));
    }
    if (!names.includes(live.selected)) live.selected = names[0];
    select.value = live.selected;
    select.parentElement.querySelector("label").hidden = select.hidden = names.length < 2;
  }
  $("live-model").addEventListener("change", () => { live.selected = $("live-model").value; scheduleDraw(); });

  // -------------------------------------------------------------- drawing

  let drawPending = false;
  function scheduleDraw() {
    if (drawPending || document.hidden || $("view-live").hidden) return;
    drawPending = true;
    requestAnimationFrame(() => { drawPending = false; draw(); });
  }
  document.addEventListener("visibilitychange", scheduleDraw);
  new ResizeObserver(scheduleDraw).observe($("view-live"));

  function fit(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
  const num = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

  // The server's power (all its models) over the throughput window, per generated token of
  // all models, and the machine's price per 1M generated tokens; "est." where estimated.
  function energyGauges() {
    const e = live.energy;
    if (!e) return [];
    let tokens = 0;
    for (const d of live.models.values()) if (d.info) tokens += d.info.gauges.generation_tokens_per_s || 0;
    const est = e.source === "estimated" ? " (est.)" : "";
    const out = [
      ["power", `Power${est}`, e.watts === null ? "–" : `${num(e.watts, 1)} W`],
      ["joules", `J / token${est}`, e.watts !== null && tokens > 0 ? num(e.watts / tokens, 3) : "–"],
    ];
    if (e.price_per_hour !== null && e.price_per_hour !== undefined) {
      out.push(["cost", "$ / 1M tokens", tokens > 0 ? `$${num(e.price_per_hour / 3600 / tokens * 1e6, 2)}` : "–"]);
    }
    return out;
  }

  function draw() {
    const d = live.models.get(live.selected);
    if (!d || !d.info) return;
    const m = d.info, g = m.gauges;
    drawModels();
    const gauges = [
      ["running", "Running", g.running], ["waiting", "Waiting", g.waiting], ["kv", "KV used", pct(g.kv_usage)],
      ["preemptions", "Preemptions", g.preemptions], ["prefix", "Prefix-cache hits", pct(g.prefix_cache_hit_rate)],
      ["spec", "Drafts accepted", pct(g.spec_acceptance)], ["generated", "Generated tok/s", num(g.generation_tokens_per_s, 1)],
      ...(g.kv_host ? [["host", "Host tier", `${num(g.kv_host.bytes / 1048576, 1)} MiB, ${g.kv_host.hits} blocks read, ${g.kv_host.evicted} evicted`]] : []),
      ...(g.kv_disk ? [["disk", "Disk tier", `${num(g.kv_disk.bytes / 1048576, 1)} MiB, ${g.kv_disk.hits} blocks read, ${g.kv_disk.evicted} evicted`]] : []),
      ...(g.kv_evicted_tokens ? [["evicted", "KV evicted", `${g.kv_evicted_tokens} tokens`]] : []),
      ["prompt", "Prompt tok/s", num(g.prompt_tokens_per_s, 1)],
      ["ttft", "TTFT p50", m.latency_ms.ttft ? `${num(m.latency_ms.ttft.p50)} ms` : "–"],
      ["itl", "ITL p50", m.latency_ms.itl ? `${num(m.latency_ms.itl.p50, 1)} ms` : "–"],
      ...energyGauges(),
    ];
    $("gauges").replaceChildren(...gauges.map(([key, label, value]) => {
      const div = document.createElement("div");
      div.dataset.gauge = key;
      const dt = document.createElement("dt"); dt.textContent = label;
      const dd = document.createElement("dd"); dd.textContent = value;
      div.append(dt, dd);
      return div;
    }));
    $("live-summary").textContent = `${m.name}: ${g.running} running, ${g.waiting} waiting, KV ${pct(g.kv_usage)} used` +
      (m.alive ? "" : " (the engine has stopped)") + (m.traced ? "" : " (this engine shows no steps)");
    drawSeries(d);
    drawBlocks(m.blocks);
    drawGantt(d);
    drawRequests(d);
    drawLatency(m.latency_ms);
    drawAdapters(m.adapters);
  }

  function drawModels() {
    const table = $("models");
    table.hidden = live.models.size < 2;
    if (table.hidden) return;
    table.tBodies[0].replaceChildren(...[...live.models.values()].map((d) => {
      const g = d.info.gauges;
      return row([d.name, g.running, g.waiting, pct(g.kv_usage), num(g.generation_tokens_per_s, 1)]);
    }));
  }

  function row(cells, data) {
    const tr = document.createElement("tr");
    for (const [k, v] of Object.entries(data || {})) tr.dataset[k] = v;
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.append(td); }
    return tr;
  }

  function axes(ctx, w, h, left, yMax, label) {
    ctx.strokeStyle = "#d9dee6"; ctx.fillStyle = "#5b6472";
    ctx.beginPath(); ctx.moveTo(left, 4); ctx.lineTo(left, h - 16); ctx.lineTo(w - 4, h - 16); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(String(yMax), left - 4, 12);
    ctx.fillText("0", left - 4, h - 16);
    ctx.textAlign = "left"; ctx.fillText("−2 min", left, h - 3);
    ctx.textAlign = "right"; ctx.fillText("now", w - 4, h - 3);
    if (label) { ctx.textAlign = "left"; ctx.fillText(label, left + 4, 12); }
  }

  function drawSeries(d) {
    const series = d.info.series, bucket = d.bucket || 0.5, span = 120;
    for (const [id, lines] of [["queue-chart", [[1, "running"], [2, "waiting"]]], ["throughput-chart", [[5, "decode"], [4, "prefill"]]]]) {
      const canvas = $(id);
      const { ctx, w, h } = fit(canvas);
      const left = 34, plotW = w - left - 6, plotH = h - 22;
      const perSecond = id === "throughput-chart";
      const value = (b, i) => (perSecond ? b[i] / bucket : b[i]);
      let yMax = perSecond ? 10 : 4;
      for (const b of series) for (const [i] of lines) yMax = Math.max(yMax, value(b, i));
      yMax = Math.ceil(yMax);
      axes(ctx, w, h, left, yMax, perSecond ? "tokens/s" : "requests");
      const x = (ago) => left + plotW * (1 + ago / span);
      const y = (v) => 4 + plotH * (1 - v / yMax);
      if (!perSecond) {  // preemptions: red ticks along the bottom
        ctx.fillStyle = color("preempted");
        for (const b of series) if (b[3] > 0) ctx.fillRect(x(b[0]), h - 22, Math.max(2, plotW * bucket / span), 6);
      }
      for (const [i, name] of lines) {
        ctx.strokeStyle = color(name); ctx.lineWidth = 2; ctx.beginPath();
        let previous = -span - bucket;
        let started = false;
        for (const b of series) {
          if (b[0] < -span) continue;
          if (b[0] - previous > bucket * 1.5 && started) {  // a gap: nothing ran then
            ctx.lineTo(x(previous + bucket), y(0)); ctx.lineTo(x(b[0]), y(0));
          }
          const v = value(b, i);
          if (!started) { ctx.moveTo(x(b[0]), y(0)); started = true; }
          ctx.lineTo(x(b[0]), y(v)); ctx.lineTo(x(b[0] + bucket), y(v));
          previous = b[0];
        }
        if (started) ctx.lineTo(x(Math.min(0, previous + bucket)), y(0));
        ctx.stroke(); ctx.lineWidth = 1;
      }
      const last = series[series.length - 1];
      canvas.setAttribute("aria-label", perSecond
        ? `Throughput: ${last ? Math.round(last[5] / bucket) : 0} generated and ${last ? Math.round(last[4] / bucket) : 0} prompt tokens per second in the latest half second`
        : `Requests: ${d.info.gauges.running} running, ${d.info.gauges.waiting} waiting`);
    }
  }

  function drawBlocks(blocks) {
    const canvas = $("block-grid");
    if (!blocks) {
      const { ctx } = fit(canvas);
      ctx.fillStyle = "#5b6472"; ctx.fillText("This engine does not show its blocks.", 8, 16);
      return;
    }
    const n = blocks.length;
    const counts = [0, 0, 0, 0];
    let hits = 0;
    for (let i = 0; i < n; i++) { const s = blocks.charCodeAt(i) - 48; counts[s & 3] += 1; if (s & 4) hits += 1; }
    // Cell size: the blocks fill the width; the canvas grows to at most 360 px high.
    const w = canvas.clientWidth || 300;
    let size = Math.max(2, Math.min(16, Math.floor(Math.sqrt((w * 180) / n))));
    let cols = Math.max(1, Math.floor(w / size));
    let group = 1;  // blocks per cell, when there are more blocks than 2-pixel cells
    while (Math.ceil(n / group / cols) * size > 360) group += 1;
    const cells = Math.ceil(n / group), rows = Math.ceil(cells / cols);
    canvas.style.height = `${Math.max(24, rows * size)}px`;
    const { ctx } = fit(canvas);
    const palette = [color("free"), color("cached"), color("used"), color("shared")];
    const gap = size >= 5 ? 1 : 0;
    for (let c = 0; c < cells; c++) {
      let state = 0, hit = false;
      for (let i = c * group; i < Math.min(n, (c + 1) * group); i++) {
        const s = blocks.charCodeAt(i) - 48;
        if ((s & 3) > (state & 3) || (state & 3) === 0) state = s & 3;
        hit = hit || (s & 4) !== 0;
      }
      ctx.fillStyle = hit ? color("hit") : palette[state];
      ctx.fillRect((c % cols) * size, Math.floor(c / cols) * size, size - gap, size - gap);
    }
    Object.assign(canvas.dataset, { blocks: n, free: counts[0], cached: counts[1], used: counts[2], shared: counts[3], hits });
    const text = `${n} blocks: ${counts[2]} in use, ${counts[3]} shared, ${counts[1]} cached, ${counts[0]} free` +
      (hits ? `, ${hits} just taken from the prefix cache` : "") + (group > 1 ? ` (${group} blocks per cell)` : "");
    $("block-counts").textContent = text;
    canvas.setAttribute("aria-label", "KV cache: " + text);
  }

  let ganttLayout = null;  // what the mouse reads: columns, rows

  function drawGantt(d) {
    const canvas = $("gantt");
    const { ctx, w, h } = fit(canvas);
    const left = 44, top = 4, bottom = 16;
    const batches = d.steps.filter((s) => s.seqs.length || s.preempted.length);  // (not the records of ends between steps)
    const colW = Math.max(3, Math.min(14, (w - left) / Math.max(1, batches.length)));
    const steps = batches.slice(-Math.floor((w - left) / colW));
    const order = new Map();  // request -> row, in order of first appearance
    for (const s of steps) for (const seq of s.seqs) if (!order.has(seq[0])) order.set(seq[0], order.size);
    for (const s of steps) for (const label of s.preempted) if (!order.has(label)) order.set(label, order.size);
    const maxRows = Math.floor((h - top - bottom) / 6);
    const labels = [...order.keys()].slice(-maxRows);
    const rowOf = new Map(labels.map((l, i) => [l, i]));
    const rowH = Math.max(6, Math.min(18, (h - top - bottom) / Math.max(1, labels.length)));
    let maxChunk = 1;
    for (const s of steps) for (const seq of s.seqs) if (seq[1] === "prefill") maxChunk = Math.max(maxChunk, seq[2]);
    ctx.textAlign = "right"; ctx.fillStyle = "#5b6472";
    if (rowH >= 10) labels.forEach((l, i) => ctx.fillText(l, left - 4, top + i * rowH + rowH / 2 + 4));
    steps.forEach((s, col) => {
      const x = left + col * colW;
      for (const [label, kind, tokens, drafts, accepted, cached, , finish] of s.seqs) {
        const r = rowOf.get(label);
        if (r === undefined) continue;
        const y = top + r * rowH, cw = colW - (colW > 4 ? 1 : 0), ch = rowH - 1;
        if (kind === "prefill") {
          const share = cached > 0 ? cached / (cached + tokens) : 0;
          ctx.fillStyle = color("cachedprefix"); ctx.fillRect(x, y, cw * share, ch);
          ctx.globalAlpha = 0.35 + 0.65 * Math.min(1, tokens / maxChunk);
          ctx.fillStyle = color("prefill"); ctx.fillRect(x + cw * share, y, cw * (1 - share), ch);
          ctx.globalAlpha = 1;
        } else if (kind === "verify" && drafts > 0) {
          const kept = ch * (accepted / (drafts + 1)), lost = ch * ((drafts - accepted) / (drafts + 1));
          ctx.fillStyle = color("decode"); ctx.fillRect(x, y + kept + lost, cw, ch - kept - lost);
          ctx.fillStyle = color("accepted"); ctx.fillRect(x, y + lost, cw, kept);
          ctx.fillStyle = color("rejected"); ctx.fillRect(x, y, cw, lost);
        } else {
          ctx.fillStyle = color("decode"); ctx.fillRect(x, y, cw, ch);
        }
        if (finish) { ctx.fillStyle = "#17202e"; ctx.fillRect(x + cw - 2, y, 2, ch); }
      }
      for (const label of s.preempted) {
        const r = rowOf.get(label);
        if (r === undefined) continue;
        ctx.strokeStyle = color("preempted"); ctx.lineWidth = 2;
        ctx.beginPath(); ctx.moveTo(x, top + r * rowH); ctx.lineTo(x + colW, top + (r + 1) * rowH); ctx.stroke();
        ctx.lineWidth = 1;
      }
    });
    ctx.fillStyle = "#5b6472"; ctx.textAlign = "left";
    if (steps.length) {
      ctx.fillText(`step ${steps[0].step}`, left, h - 3);
      ctx.textAlign = "right"; ctx.fillText(`step ${steps[steps.length - 1].step}`, w - 4, h - 3);
    } else {
      ctx.fillText("No step yet: send a request.", left, h / 2);
    }
    canvas.dataset.steps = steps.length;
    canvas.dataset.requests = labels.length;
    canvas.setAttribute("aria-label", `The last ${steps.length} steps of ${labels.length} requests`);
    ganttLayout = { left, colW, steps };
  }

  function describeStep(s) {
    const tokens = s.seqs.reduce((a, q) => a + q[2], 0);
    const parts = s.seqs.slice(0, 8).map(([label, kind, t, drafts, accepted, cached]) =>
      `${label} ${kind} ${t}` + (kind === "verify" ? ` (${accepted}/${drafts} drafts kept)` : "") + (cached ? ` (+${cached} cached)` : ""));
    return `step ${s.step}: ${(s.duration * 1000).toFixed(1)} ms, ${s.seqs.length} sequences, ${tokens} tokens` +
      (s.preempted.length ? `, preempted ${s.preempted.join(" ")}` : "") + ` — ${parts.join(", ")}${s.seqs.length > 8 ? ", …" : ""}`;
  }

  $("gantt").addEventListener("mousemove", (e) => {
    if (!ganttLayout) return;
    const rect = e.target.getBoundingClientRect();
    const col = Math.floor((e.clientX - rect.left - ganttLayout.left) / ganttLayout.colW);
    const s = ganttLayout.steps[col];
    $("gantt-detail").textContent = s ? describeStep(s) : "";
  });

  function drawRequests(d) {
    const recent = [...d.requests.values()].slice(-REQUESTS_SHOWN).reverse();
    $("requests").tBodies[0].replaceChildren(...recent.map((r) => {
      const tr = row(
        [r.label, r.state === "finished" ? `finished (${r.finish})` : r.state,
          `${r.prompt} prompt${r.cached ? ` (+${r.cached} cached)` : ""} + ${r.generated}`, r.steps, r.lora || "–"],
        { request: r.label, state: r.state, history: r.history.join(" ") });
      tr.title = r.history.join(" → ");  // (between two events a short request is seen only finished)
      return tr;
    }));
  }

  function drawLatency(latency) {
    $("latency").tBodies[0].replaceChildren(...[["TTFT", latency.ttft], ["Inter-token", latency.itl]].map(([name, p]) =>
      row([name, p ? num(p.p50, 1) : "–", p ? num(p.p90, 1) : "–", p ? num(p.p99, 1) : "–"])));
  }

  function drawAdapters(adapters) {
    $("adapters").hidden = !adapters;
    if (!adapters) return;
    $("adapters").tBodies[0].replaceChildren(...adapters.map((a) =>
      row([a.name, a.running ? "yes" : "no", a.waiting ? "yes" : "no", a.requests])));
  }

  // ------------------------------------------------------------------ start

  if (document.cookie.split("; ").includes("tokenmill_signed_in=1")) $("sign-out").hidden = false;
  load();
  renderAll();
  loadModels();
  showTab(location.hash === "#live" ? "live" : "chat", false);
})();
