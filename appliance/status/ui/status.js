// chat-appliance status page and playground: plain browser JavaScript, no build step, no CDN.
// Data comes from /status.json (polled) and the OpenAI routes; everything is written with
// textContent, never as HTML, so nothing the engine or a client sends can run here.
"use strict";

(() => {
  const KEY_STORE = "chat-appliance.api-key"; // sessionStorage: this tab only, never a URL
  const $ = (id) => document.getElementById(id);
  let apiKey = sessionStorage.getItem(KEY_STORE);
  let pollTimer = null;
  let refreshMs = 2000;
  let engineState = null;
  let lastDoc = null;
  let messages = [];
  let controller = null;

  // ---- the API key ------------------------------------------------------------------------

  function authHeaders() {
    return apiKey ? { Authorization: "Bearer " + apiKey } : {};
  }

  function askForKey() {
    apiKey = null;
    sessionStorage.removeItem(KEY_STORE);
    $("key-form").hidden = false;
    $("key-input").focus();
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const typed = $("key-input").value.trim();
    if (!typed) return;
    apiKey = typed;
    sessionStorage.setItem(KEY_STORE, typed);
    $("key-input").value = "";
    $("key-form").hidden = true;
    engineState = null; // reload the model list with the key
    poll();
  });

  // ---- polling ----------------------------------------------------------------------------

  async function poll() {
    clearTimeout(pollTimer);
    try {
      const response = await fetch("/status.json", { headers: authHeaders(), cache: "no-store" });
      if (response.status === 401) {
        showUnreachable("key needed");
        askForKey();
        return; // polling resumes once a key is typed
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
    } catch (err) {
      showUnreachable("unreachable");
    }
    pollTimer = setTimeout(poll, refreshMs);
  }

  const HINTS = {
    starting: "the engine is starting (loading the model); requests get 503 with Retry-After until it is ready",
    backoff: "the engine stopped and restarts after a short pause; requests get 503 with Retry-After",
    stopping: "the engine is being stopped; requests get 503 with Retry-After",
    unhealthy: "the engine is not answering its health checks",
    failed: "the engine is not being restarted (a crash loop, or a GPU a restart cannot fix); see the last exits",
    draining: "the appliance is shutting down: requests in flight finish, new ones get 503",
    stopped: "the engine is stopped",
    unloaded: "the model is not loaded (residency); a request for it loads it",
    sleeping: "the model's worker sleeps (residency, sleep mode): its weights in host memory; a request for it wakes it",
  };

  function setBanner(state, lastExit) {
    const banner = $("banner");
    banner.hidden = state === "ready";
    if (banner.hidden) return;
    const why = lastExit ? " — last exit: " + lastExit.detail : "";
    banner.textContent = "Engine " + state + ": " + (HINTS[state] || state) + why;
    banner.className = "state-" + state;
  }

  function showUnreachable(text) {
    setPill(text, "unreachable");
    const banner = $("banner");
    banner.hidden = false;
    banner.className = "state-unreachable";
    banner.textContent = text === "key needed" ? "This appliance needs an API key to show its status."
      : "The appliance does not answer; the data below may be old.";
    document.body.classList.add("stale");
    $("updated").textContent = lastDoc ? "last data " + clock(lastDoc.at) : "";
    engineState = null;
    updateSendButton();
  }

  function setPill(text, css) {
    const pill = $("state");
    pill.textContent = text;
    pill.className = "pill state-" + css;
  }

  // ---- rendering the status document --------------------------------------------------------

  function render(doc) {
    lastDoc = doc;
    refreshMs = Math.max(500, (doc.refresh_s || 2) * 1000);
    document.body.classList.remove("stale");
    const engine = doc.engine;
    setPill(engine.state, engine.state);
    setBanner(engine.state, engine.last_exit);
    $("model").textContent = engine.model || "";
    $("updated").textContent = "updated " + clock(doc.at);
    renderEngine(engine);
    renderRequests(doc.requests);
    renderGpu(engine.gpu || {});
    renderRecent(doc.recent);
    renderModels(doc.models || []);
    renderExits(engine.recent_exits || (engine.last_exit ? [engine.last_exit] : []), engine.state);
    if (engine.state === "ready" && engineState !== "ready") loadModels();
    engineState = engine.state;
    updateSendButton();
  }

  function renderEngine(engine) {
    $("engine-state").textContent = engine.state;
    $("engine-pid").textContent = engine.pid ?? "–";
    $("engine-uptime").textContent = engine.uptime_s == null ? "not ready" : duration(engine.uptime_s);
    $("supervisor-uptime").textContent = duration(engine.supervisor_uptime_s);
    $("engine-restarts").textContent = engine.restarts;
    // The bundle names clients and requests: the page names the command that shows it, on
    // the appliance's own console, rather than serving it to anyone who can read the page.
    $("engine-crash").textContent = engine.last_crash ? "chat-appliance crashes " + engine.last_crash : "none";
    renderCanary(engine.canary);
  }

  // "200 OK but garbage" has no other sign: a mismatch is said in words, and marked.
  function renderCanary(canary) {
    const cell = $("engine-canary");
    cell.classList.toggle("canary-mismatch", !!canary && canary.ok === false);
    if (!canary) { cell.textContent = "not checked yet"; return; }
    const words = {pass: "ok", recorded: "recorded for this model", disabled: "disabled",
                   mismatch: "MISMATCH", error: "not judged"};
    const said = words[canary.verdict] || canary.verdict;
    cell.textContent = canary.detail ? said + ": " + canary.detail : said;
  }

  function renderRequests(requests) {
    $("in-flight").textContent = requests.in_flight + " of " + requests.max_inflight;
    $("engine-queue").textContent = requests.engine_running == null ? "–"
      : requests.engine_running + " / " + requests.engine_waiting;
    const aborts = requests.disconnect_aborts || {};
    $("disconnects").textContent = (aborts["true"] || 0) + " streaming · " + (aborts["false"] || 0) + " other";
    const reasons = Object.entries(requests.rejected || {}).sort((a, b) => b[1] - a[1]);
    $("rejected").textContent = reasons.length ? reasons.map(([r, n]) => r + " " + n).join(" · ") : "none";
    renderQuarantined(requests.quarantined);
  }

  // Fingerprints only: the request itself is in the crash bundles, on the appliance's console.
  function renderQuarantined(held) {
    if (!held || !held.count) {
      $("quarantined").textContent = "none";
      return;
    }
    const last = (entry) => clock(entry.last_refused_at || entry.last_death_at);
    $("quarantined").textContent = held.count + ": " + held.newest.map((entry) =>
      entry.fingerprint + " (" + entry.deaths + " deaths, refused " + entry.refused + ", last " +
      last(entry) + ")").join(" · ");
  }

  function renderGpu(gpu) {
    const list = $("gpu");
    const rows = [["Status", gpu.status || "unknown"]];
    if (gpu.status === "unavailable" || gpu.status === "disabled") {
      rows.push(["", "no NVIDIA GPU monitored (CPU engine)"]);
    } else {
      rows.push(["Name", gpu.name || "–"]);
      rows.push(["Temperature", gpu.temperature_c == null ? "–" : gpu.temperature_c + " °C"]);
      rows.push(["Memory", gpu.memory_used_bytes == null ? "–"
        : gib(gpu.memory_used_bytes) + " of " + gib(gpu.memory_total_bytes) + " GiB"]);
      rows.push(["Utilisation", gpu.utilization_pct == null ? "–" : gpu.utilization_pct + " %"]);
      rows.push(["Slowdown", (gpu.slowdown_reasons || []).join(", ") || "none"]);
      rows.push(["Last Xid", gpu.last_xid == null ? "none" : String(gpu.last_xid)]);
      const health = gpu.health || {};
      rows.push(["Health", !health.action || health.action === "none" ? "ok" : health.action + ": " + health.cause]);
      if ((gpu.warnings || []).length) rows.push(["Warnings", gpu.warnings.join("; ")]);
    }
    list.replaceChildren(...rows.flatMap(([term, value]) => [element("dt", term), element("dd", value)]));
  }

  function renderRecent(recent) {
    const series = recent.series;
    const rate = recent.tokens_per_s == null ? "–" : recent.tokens_per_s.toFixed(1);
    const ttft = recent.mean_ttft_s == null ? "–" : latency(recent.mean_ttft_s);
    $("recent-summary").textContent = "now " + rate + " tokens/s · mean TTFT " + ttft
      + " (averaged over " + recent.window_s + " s at each point)";
    drawChart($("chart-tokens"), series.t, series.tokens_per_s, { colour: "#2f6fdf", label: String, span: duration });
    drawChart($("chart-ttft"), series.t, series.ttft_s, { colour: "#d98e04", label: latency, span: duration });
  }

  function renderModels(models) {
    const rows = models.map((model) => {
      const row = document.createElement("tr");
      const role = [model.default ? "default" : "", model.pinned ? "pinned" : ""].filter(Boolean).join(", ");
      for (const text of [model.name, (model.aliases || []).join(", "), model.state, model.pid ?? "–",
        model.restarts, role || "–"]) row.append(element("td", String(text)));
      return row;
    });
    $("models").tBodies[0].replaceChildren(...rows);
  }

  function renderExits(exits, state) {
    $("exits-empty").hidden = exits.length > 0;
    $("exits").hidden = exits.length === 0;
    const rows = exits.map((exit, index) => {
      const row = document.createElement("tr");
      for (const text of [clock(exit.at), exit.phase, exit.reason, exit.detail]) row.append(element("td", text));
      const restart = exit.restart || {};
      if (restart.total_s != null) {
        row.append(element("td", [restart.stop_s, restart.backoff_s, restart.boot_s].map(seconds).join(" · ")
          + " = " + seconds(restart.total_s)));
      } else {
        const pending = index === 0 && state !== "ready" && state !== "failed" && state !== "stopped";
        const cell = element("td", pending ? "restarting…" : "no restart");
        if (pending) cell.className = "restarting";
        row.append(cell);
      }
      return row;
    });
    $("exits").tBodies[0].replaceChildren(...rows);
  }

  // ---- the playground -----------------------------------------------------------------------

  async function loadModels() {
    try {
      const response = await fetch("/v1/models", { headers: authHeaders() });
      if (response.status === 401) { askForKey(); return; }
      if (!response.ok) return;
      const select = $("play-model"), current = select.value;
      const ids = (await response.json()).data.map((model) => model.id);
      select.replaceChildren(...ids.map((id) => new Option(id, id)));
      if (ids.includes(current)) select.value = current;
    } catch (err) {
      // the next poll that sees the engine ready tries again
      engineState = null;
    }
    updateSendButton();
  }

  function updateSendButton() {
    const send = $("send");
    send.disabled = controller !== null || engineState !== "ready" || !$("play-model").value;
    send.title = engineState === "ready" ? "" : "the engine is not ready";
  }

  async function send(text) {
    messages.push({ role: "user", content: text });
    addTurn("user", text);
    const answer = addTurn("assistant", "");
    controller = new AbortController();
    $("stop").disabled = false;
    updateSendButton();
    playStatus("waiting for the first token…");
    $("request-id").textContent = "–";
    const reply = { text: "" };
    try {
      await streamAnswer(answer, reply, controller.signal);
    } catch (err) {
      if (err.name === "AbortError") {
        playStatus("stopped: the request was aborted on the engine");
      } else {
        playStatus("failed");
        addTurn("error", err.message || String(err));
      }
    } finally {
      if (reply.text) messages.push({ role: "assistant", content: reply.text });
      else messages.pop(); // nothing came back: the question leaves the conversation too
      controller = null;
      $("stop").disabled = true;
      updateSendButton();
    }
  }

  async function streamAnswer(answer, reply, signal) {
    const body = { model: $("play-model").value, messages: messages, stream: true,
                   max_tokens: Number($("play-max-tokens").value) || undefined };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: signal, body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...authHeaders() },
    });
    $("request-id").textContent = response.headers.get("x-request-id") || "–";
    if (response.status === 401) { askForKey(); throw new Error("an API key is needed: type it above, then send again"); }
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(response.status + ": " + ((error && error.error && error.error.message) || response.statusText));
    }
    let chunks = 0, finish = null;
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the answer ended with an error");
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta && choice.delta.content;
      if (delta) {
        answer.append(delta);
        reply.text += delta;
        chunks += 1;
        playStatus("streaming… " + chunks + " chunks");
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    playStatus("done: " + (finish || "end of stream") + ", " + chunks + " chunks");
  }

  async function* sseData(stream) {
    const reader = stream.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data) yield data;
      }
    }
  }

  function addTurn(who, text) {
    const turn = document.createElement("div");
    turn.className = "turn " + who;
    const label = element("span", who);
    label.className = "who";
    turn.append(label, text);
    $("transcript").append(turn);
    return turn;
  }

  function playStatus(text) {
    $("play-status").textContent = text;
  }

  $("play-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || $("send").disabled) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("play-form").requestSubmit();
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("play-new").addEventListener("click", () => {
    if (controller) controller.abort();
    messages = [];
    $("transcript").replaceChildren();
    playStatus("idle");
  });
  $("play-model").addEventListener("change", updateSendButton);

  // ---- small helpers ------------------------------------------------------------------------

  function element(tag, text) {
    const node = document.createElement(tag);
    node.textContent = text;
    return node;
  }

  function duration(s) {
    if (s == null) return "–";
    s = Math.round(s);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h " + String(Math.floor(s / 60) % 60).padStart(2, "0") + "m";
  }

  function seconds(s) {
    return s == null ? "–" : (s < 10 ? s.toFixed(2) : s.toFixed(1)) + " s";
  }

  function latency(s) {
    // toPrecision writes 270 ms as "2.7e+2": round to two significant digits as a number
    return s < 1 ? Number((s * 1000).toPrecision(2)) + " ms" : s.toFixed(2) + " s";
  }

  function gib(bytes) {
    return (bytes / 1073741824).toFixed(1);
  }

  function clock(epochSeconds) {
    return new Date(epochSeconds * 1000).toLocaleTimeString();
  }

  poll();
})();
