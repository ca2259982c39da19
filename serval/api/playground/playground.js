// The playground page: settings, the conversation, sending and stopping, the API key. The key lives in this
// closure only (never in storage or cookies), so closing the tab forgets it. stream.js does the wire.
"use strict";

(() => {
  const { APIError, streamChat, timingStrip } = window.servalStream;
  const $ = (id) => document.getElementById(id);
  let apiKey = null;
  let turns = []; // the conversation sent with each request (the system prompt is added then)
  let controller = null; // the running request's AbortController

  const headers = () => (apiKey ? { Authorization: `Bearer ${apiKey}` } : {});

  function showError(message) {
    $("error").textContent = message || "";
  }

  function askForKey(message) {
    $("key-error").textContent = message || "";
    $("key-input").value = "";
    if (!$("key-dialog").open) $("key-dialog").showModal();
    $("key-input").focus();
  }

  // /v1/models into the picker; a 401 asks for a key. True when the server answered.
  async function loadModels() {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      const body = await response.json().catch(() => ({}));
      askForKey(apiKey === null ? "" : (body.error && body.error.message) || "invalid API key");
      return false;
    }
    if (!response.ok) {
      showError(`cannot list the models: ${response.status}`);
      return false;
    }
    const select = $("model");
    select.replaceChildren();
    for (const card of (await response.json()).data) {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.parent ? `${card.id} (adapter of ${card.parent})` : card.id;
      select.appendChild(option);
    }
    return true;
  }

  function parseJSON(text, what) {
    try {
      return JSON.parse(text);
    } catch (e) {
      throw new Error(`${what} is not valid JSON: ${e.message}`);
    }
  }

  function toolDefinitions() {
    const text = $("tools").value.trim();
    if (!text) return null;
    const tools = parseJSON(text, "Tools");
    if (!Array.isArray(tools)) throw new Error("Tools must be a JSON list of tool definitions");
    return tools;
  }

  // The tool_choice picker follows the tool definitions: auto, none, required, or one named function.
  function refreshToolChoice() {
    const select = $("tool-choice");
    const previous = select.value;
    let names = [];
    try {
      names = (toolDefinitions() || []).map((tool) => tool.function && tool.function.name).filter(Boolean);
    } catch (_) { /* shown when sending */ }
    select.replaceChildren();
    for (const value of ["auto", "none", "required", ...names.map((name) => `function:${name}`)]) {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = value.startsWith("function:") ? `call ${value.slice(9)}` : value;
      select.appendChild(option);
    }
    if ([...select.options].some((o) => o.value === previous)) select.value = previous;
  }

  function requestBody() {
    const body = { model: $("model").value };
    const system = $("system").value.trim();
    body.messages = system ? [{ role: "system", content: system }, ...turns] : [...turns];
    for (const [id, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["top_k", parseInt],
                               ["max_tokens", parseInt], ["seed", parseInt]]) {
      const text = $(id).value.trim();
      if (text !== "") body[id] = parse(text, 10);
    }
    const format = $("format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      const schema = parseJSON($("schema").value, "The JSON schema");
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    const tools = toolDefinitions();
    if (tools) {
      body.tools = tools;
      const choice = $("tool-choice").value;
      body.tool_choice = choice.startsWith("function:")
        ? { type: "function", function: { name: choice.slice(9) } } : choice;
    }
    const extra = $("extra").value.trim();
    if (extra) Object.assign(body, parseJSON(extra, "Extra request fields"));
    return body;
  }

  function messageElement(role) {
    const element = document.createElement("div");
    element.className = `message ${role}`;
    element.dataset.testid = `message-${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    element.appendChild(label);
    $("messages").appendChild(element);
    return element;
  }

  function addUserMessage(text) {
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    messageElement("user").appendChild(content);
  }

  // The assistant's message, redrawn as the answer grows: reasoning folded, content, tool calls.
  function assistantView() {
    const element = messageElement("assistant");
    const reasoning = document.createElement("details");
    reasoning.className = "reasoning";
    reasoning.dataset.testid = "reasoning";
    reasoning.hidden = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const reasoningText = document.createElement("pre");
    reasoning.append(summary, reasoningText);
    const content = document.createElement("div");
    content.className = "content";
    content.dataset.testid = "content";
    const calls = document.createElement("div");
    element.append(reasoning, content, calls);
    return {
      element,
      update(answer) {
        reasoning.hidden = !answer.reasoning;
        reasoningText.textContent = answer.reasoning;
        content.textContent = answer.content;
        calls.replaceChildren(...answer.toolCalls.map(toolCallElement));
        $("messages").scrollTop = $("messages").scrollHeight;
      },
    };
  }

  function toolCallElement(call) {
    const element = document.createElement("div");
    element.className = "tool-call";
    element.dataset.testid = "tool-call";
    const name = document.createElement("span");
    name.className = "tool-name";
    name.textContent = call.name;
    const args = document.createElement("pre");
    args.className = "tool-arguments";
    try {
      args.textContent = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch (_) {
      args.textContent = call.arguments; // still streaming, or cut off
    }
    element.append(name, args);
    return element;
  }

  async function send(text) {
    showError("");
    let body;
    turns.push({ role: "user", content: text });
    try {
      body = requestBody();
    } catch (e) {
      turns.pop();
      showError(e.message);
      return;
    }
    addUserMessage(text);
    $("prompt").value = "";
    const view = assistantView();
    controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    let answer = null;
    try {
      answer = await streamChat("/v1/chat/completions", body, headers(), controller.signal, (a) => {
        answer = a;
        view.update(a);
      });
      view.update(answer);
      view.element.appendChild(timingStrip(answer));
    } catch (e) {
      if (e.name === "AbortError") {
        const note = document.createElement("div");
        note.className = "stopped";
        note.dataset.testid = "stopped";
        note.textContent = "stopped";
        view.element.appendChild(note);
      } else {
        showError(e.message);
        if (e instanceof APIError && e.status === 401) askForKey(e.message);
        if (!answer) view.element.remove();
      }
    } finally {
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
    if (answer && (answer.content || answer.toolCalls.length)) {
      // NOTE: tool calls are shown, not run: the conversation goes on with the answer's text.
      turns.push({ role: "assistant", content: answer.content });
    } else {
      turns.pop();
    }
  }

  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (text.trim() && !controller) send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    turns = [];
    $("messages").replaceChildren();
    showError("");
  });
  $("format").addEventListener("change", () => {
    $("schema-label").hidden = $("format").value !== "json_schema";
  });
  $("tools").addEventListener("input", refreshToolChoice);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = $("key-input").value;
    $("key-dialog").close();
    loadModels();
  });

  refreshToolChoice();
  loadModels();
})();
