// Streaming for the playground: POST a chat request, read its server-sent events as they arrive, fold the
// chunks into one answer (content, reasoning, tool calls, usage and the MindIE timing fields), and draw the
// timing strip under a finished answer. No DOM of its own but the strip; the page (playground.js) renders.
"use strict";

window.servalStream = (() => {
  class APIError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // The OpenAI error body's message, or the status line.
  async function errorOf(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON */ }
    return new APIError(response.status, message);
  }

  function newAnswer() {
    return { content: "", reasoning: "", toolCalls: [], finishReason: null, usage: null,
             prefillTime: null, decodeTimes: null, sentAt: performance.now(), firstAt: null, stopped: false };
  }

  // One chunk into the answer; true when it brought something to show.
  function fold(answer, chunk) {
    if (chunk.error) throw new APIError(0, chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) answer.usage = chunk.usage;
    if (chunk.prefill_time !== undefined) answer.prefillTime = chunk.prefill_time;
    if (chunk.decode_time_arr !== undefined) answer.decodeTimes = chunk.decode_time_arr;
    let shown = false;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content) { answer.content += delta.content; shown = true; }
      if (delta.reasoning_content) { answer.reasoning += delta.reasoning_content; shown = true; }
      for (const call of delta.tool_calls || []) {
        const index = call.index || 0;
        while (answer.toolCalls.length <= index) answer.toolCalls.push({ id: "", name: "", arguments: "" });
        const target = answer.toolCalls[index];
        if (call.id) target.id = call.id;
        if (call.function && call.function.name) target.name += call.function.name;
        if (call.function && call.function.arguments) target.arguments += call.function.arguments;
        shown = true;
      }
      if (choice.finish_reason) answer.finishReason = choice.finish_reason;
    }
    if (shown && answer.firstAt === null) answer.firstAt = performance.now();
    return shown;
  }

  // POST body (stream: true) to path; onUpdate(answer) after every chunk that shows something. Resolves
  // with the answer when [DONE] comes; an abort of `signal` rejects with an AbortError (the connection
  // closes, and the server cancels the request).
  async function streamChat(path, body, headers, signal, onUpdate) {
    const answer = newAnswer();
    const response = await fetch(path, {
      method: "POST", headers: { "Content-Type": "application/json", ...headers },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }), signal,
    });
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return answer;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return answer;
        if (fold(answer, JSON.parse(data))) onUpdate(answer);
      }
    }
  }

  const SVG = "http://www.w3.org/2000/svg";

  // A small line chart of the decode steps' times (ms), one point per step, the slowest at the top.
  function decodeChart(times) {
    const svg = document.createElementNS(SVG, "svg");
    const width = 160, height = 28;
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("role", "img");
    const most = Math.max(...times), least = Math.min(...times);
    const label = `decode step times: ${times.length} steps, ${least.toFixed(1)}-${most.toFixed(1)} ms`;
    svg.setAttribute("aria-label", label);
    const title = document.createElementNS(SVG, "title");
    title.textContent = label;
    svg.appendChild(title);
    const line = document.createElementNS(SVG, "polyline");
    const step = times.length > 1 ? width / (times.length - 1) : 0;
    line.setAttribute("points", times.map((t, i) =>
      `${(i * step).toFixed(1)},${(height - 2 - (most > 0 ? (t / most) * (height - 4) : 0)).toFixed(1)}`).join(" "));
    svg.appendChild(line);
    return svg;
  }

  // The strip under an answer: time to first token (as the page saw it, and the server's prefill), decode
  // speed from decode_time_arr, tokens, cached prompt tokens, and the chart.
  function timingStrip(answer) {
    const strip = document.createElement("div");
    strip.className = "timing";
    strip.dataset.testid = "timing";
    const item = (name, text) => {
      const span = document.createElement("span");
      span.dataset.field = name;
      span.textContent = text;
      strip.appendChild(span);
    };
    if (answer.firstAt !== null) item("ttft", `TTFT ${Math.round(answer.firstAt - answer.sentAt)} ms`);
    if (answer.prefillTime !== null) item("prefill", `prefill ${answer.prefillTime.toFixed(1)} ms`);
    const usage = answer.usage || {};
    if (usage.completion_tokens !== undefined) item("tokens", `${usage.completion_tokens} tokens`);
    const times = answer.decodeTimes || [];
    const decodeMs = times.reduce((a, b) => a + b, 0);
    if (times.length && decodeMs > 0) item("speed", `${(times.length / (decodeMs / 1000)).toFixed(1)} tokens/s`);
    const cached = (usage.prompt_tokens_details || {}).cached_tokens;
    if (cached !== undefined) item("cached", `${cached} cached prompt tokens`);
    if (times.length) strip.appendChild(decodeChart(times));
    return strip;
  }

  return { APIError, streamChat, timingStrip };
})();
