// The flashpage playground: a chat that streams from /v1/chat/completions and a live panel fed by /stats.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, model: null };

const keyInput = $("api-key");
keyInput.value = sessionStorage.getItem("flashpage-key") || "";
keyInput.addEventListener("change", () => sessionStorage.setItem("flashpage-key", keyInput.value));

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyInput.value) h.Authorization = "Bearer " + keyInput.value;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("error").textContent = "";
  $("prompt").value = "";
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".text");
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const t0 = performance.now();
  let first = null, tokens = 0, reply = "";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      signal: state.controller.signal,
      body: JSON.stringify({
        model: state.model,
        messages: state.history,
        stream: true,
        stream_options: { include_usage: true },
        temperature: Number($("temperature").value),
        max_tokens: Number($("max-tokens").value),
      }),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) {
            if (first === null) first = performance.now();
            reply += c.delta.content;
            out.textContent = reply;
          }
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("error").textContent = e.message;
  } finally {
    state.history.push({ role: "assistant", content: reply });
    const secs = (performance.now() - t0) / 1000;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = `${tokens} tokens · ${secs.toFixed(2)} s` + (first !== null ? ` · first token ${((first - t0)).toFixed(0)} ms` : "");
    div.appendChild(meta);
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; });

// ------------------------------------------------------------------ the live panel

const fmt = (x, d = 1) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

function drawRoofline(s) {
  const svg = $("roofline");
  const W = 360, H = 220, L = 40, B = 24, T = 10, R = 10;
  const peak = s.peak_tflops, bw = s.peak_tbps;
  if (!peak || !bw) { svg.innerHTML = ""; return; }
  const ridge = (peak * 1e12) / (bw * 1e12);
  const xs = [ridge / 100, ridge * 100];
  for (const p of s.phases) if (p.intensity > 0) { xs[0] = Math.min(xs[0], p.intensity / 3); xs[1] = Math.max(xs[1], p.intensity * 3); }
  const lx0 = Math.log10(xs[0]), lx1 = Math.log10(xs[1]);
  const ly1 = Math.log10(peak * 2), ly0 = Math.log10(Math.min(peak, (xs[0] * bw * 1e12) / 1e12) / 2);
  const X = (v) => L + ((Math.log10(v) - lx0) / (lx1 - lx0)) * (W - L - R);
  const Y = (v) => H - B - ((Math.log10(v) - ly0) / (ly1 - ly0)) * (H - B - T);
  const att = (i) => Math.min(peak, (i * bw * 1e12) / 1e12);
  let g = `<line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>`;
  g += `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>`;
  g += `<polyline class="roof" points="${X(xs[0])},${Y(att(xs[0]))} ${X(ridge)},${Y(peak)} ${X(xs[1])},${Y(peak)}"/>`;
  g += `<text x="${X(ridge) + 4}" y="${Y(peak) + 12}">ridge ${ridge.toFixed(0)} FLOP/B</text>`;
  g += `<text x="${W - R}" y="${H - 6}" text-anchor="end">FLOP/byte (log)</text>`;
  g += `<text x="4" y="${T + 8}">TFLOP/s</text>`;
  for (const p of s.phases) {
    if (!(p.intensity > 0)) continue;
    const x = X(p.intensity), y = Y(att(p.intensity));
    g += `<circle class="pt-${p.bound}" cx="${x}" cy="${y}" r="5"><title>${p.phase}: ${p.kernel}</title></circle>`;
    g += `<text x="${x + 7}" y="${y - 6}">${p.phase}</text>`;
  }
  svg.innerHTML = g;
}

async function poll() {
  try {
    const resp = await fetch("/stats");
    const s = await resp.json();
    if (!state.model) state.model = s.served_model_names[0];
    $("model").textContent = `${s.model} · ${s.device} · ${s.dtype} · context ${s.max_model_len}`;
    $("running").textContent = s.num_requests_running;
    $("waiting").textContent = s.num_requests_waiting;
    $("tps").textContent = fmt(s.generation_tokens_per_s);
    $("ttft").textContent = s.ttft_ms_p50 === null ? "–" : fmt(s.ttft_ms_p50, 0) + " ms";
    $("prefix").textContent = fmt(100 * s.prefix_cache_hit_rate) + " %";
    $("preempt").textContent = s.num_preemptions;
    const kv = 100 * s.kv_cache_usage_perc;
    $("kv-bar").style.width = kv.toFixed(1) + "%";
    $("kv-text").textContent = `${fmt(kv)} % (${s.kv_blocks_used} / ${s.kv_blocks_total} blocks)`;
    $("hw").textContent = s.hardware ? `(${s.hardware})` : "";
    const rows = s.phases.map((p) =>
      `<tr data-phase="${p.phase}"><td>${p.phase}</td><td>${p.kernel}</td><td>${p.num_splits}</td>` +
      `<td>${fmt(p.intensity, 2)}</td><td>${p.bound}</td><td>${p.steps}</td></tr>`);
    $("phases").querySelector("tbody").innerHTML = rows.join("");
    drawRoofline(s);
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}
poll();
setInterval(poll, 1000);
