// openbook web page: ask a question, watch the answer being written (POST /answer with
// "stream": true, Server-Sent Events), then see the passages and where each token came from.
// Vanilla JS, no dependencies. Text from the API is only ever set with textContent.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);

  // Builds an element: el("p", {class: "x"}, "text", child, ...). Strings become text nodes.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  const pct = (p) => (p * 100).toFixed(p >= 0.995 || p < 0.0995 ? 0 : 1) + "%";
  const fmt = (x, digits = 3) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

  // A generated token as people read it: no leading space, visible when it is only whitespace.
  function tokenLabel(token) {
    const trimmed = token.replace(/^[\sĠ▁]+|\s+$/g, "");
    if (trimmed) return trimmed;
    return token.includes("\n") ? "⏎" : "␣";
  }

  // Turns a FastAPI error body into one readable line.
  function errorText(status, body) {
    const detail = body && body.detail;
    if (Array.isArray(detail)) {
      return detail
        .map((d) => {
          const loc = (d.loc || []).filter((part) => part !== "body").join(".");
          return loc ? `${loc}: ${d.msg}` : d.msg;
        })
        .join("; ");
    }
    if (typeof detail === "string") return detail;
    return `the gateway answered HTTP ${status}`;
  }

  // The key a deployment that requires one (OPENBOOK_GATEWAY_REQUIRE_KEYS) asks for: its field
  // appears the first time the gateway answers 401 to a request sent without one. Kept in the
  // page only (never in storage), sent as the bearer of every request that names no other.
  const keyField = $("key-field");
  const keyInput = $("api-key");

  function withKey(headers) {
    const key = keyInput.value.trim();
    if (!key || (headers && headers.Authorization)) return headers || {};
    return { Authorization: `Bearer ${key}`, ...headers };
  }

  // A 401 to a request sent without a credential of its own: show the key's field.
  function askForKey(status, headers) {
    if (status !== 401 || (headers && headers.Authorization)) return false;
    keyField.hidden = false;
    return true;
  }

  keyInput.addEventListener("change", () => refreshIndexes());

  // A call of the gateway's JSON API: body an object sent as JSON, or FormData (a file) sent as
  // multipart. Resolves to the reply's JSON; rejects with the gateway's message and .status.
  async function api(method, path, body, headers) {
    const form = body instanceof FormData;
    let response;
    try {
      response = await fetch(path, {
        method,
        // No Content-Type for a form: the browser writes the multipart boundary.
        headers: withKey({ Accept: "application/json", ...(body && !form ? { "Content-Type": "application/json" } : {}), ...headers }),
        body: form ? body : body ? JSON.stringify(body) : undefined,
      });
    } catch (err) {
      throw new Error("cannot reach the gateway (" + err.message + ")");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = null;
    }
    if (!response.ok) {
      const needed = askForKey(response.status, headers);
      const error = new Error(
        needed ? "this gateway needs a key: enter it in the Key field" : errorText(response.status, data)
      );
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function showError(node, message) {
    node.textContent = message || "";
    node.hidden = !message;
  }

  // A text/event-stream parser: push() decoded text as it arrives (an event, even a line, may
  // be split across chunks), end() when the body is done. onEvent(name, data) once per event.
  function eventStream(onEvent) {
    let buffer = "";
    let name = "";
    let data = [];
    function line(text) {
      if (text === "") {
        if (data.length) onEvent(name || "message", data.join("\n"));
        name = "";
        data = [];
        return;
      }
      if (text.startsWith(":")) return; // a comment (keep-alive)
      const colon = text.indexOf(":");
      const field = colon < 0 ? text : text.slice(0, colon);
      let value = colon < 0 ? "" : text.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
    }
    return {
      push(text) {
        buffer += text;
        const ends = /\r\n|\r|\n/g;
        let start = 0;
        let match;
        while ((match = ends.exec(buffer))) {
          // A lone "\r" at the end may be the first half of "\r\n": wait for the next chunk.
          if (match[0] === "\r" && ends.lastIndex === buffer.length) break;
          line(buffer.slice(start, match.index));
          start = ends.lastIndex;
        }
        buffer = buffer.slice(start);
      },
      end() {
        if (buffer) line(buffer.replace(/\r$/, ""));
        buffer = "";
        line(""); // an event the body ended without a blank line after
      },
    };
  }

  // ------------------------------------------------------------------ active index

  const indexBadge = $("active-index");
  let knownIndexes = [];

  function setActiveIndex(name, state) {
    indexBadge.textContent = name || "none";
    indexBadge.dataset.state = state || (name ? "ok" : "none");
    indexBadge.title = name ? `Active index: ${name}` : "No active index";
  }

  async function refreshIndexes() {
    try {
      const data = await api("GET", "/indexes");
      knownIndexes = data.indexes || [];
      setActiveIndex(data.active, "ok");
    } catch (err) {
      setActiveIndex("unavailable", "error");
      indexBadge.title = err.message;
    }
  }

  // ------------------------------------------------------------------ asking

  const form = $("ask-form");
  const question = $("question");
  const askButton = $("ask-button");
  const formError = $("form-error");
  const result = $("result");
  const answerNode = $("answer");
  const answerStatus = $("answer-status");
  let busy = false;

  function intField(id, optional = false) {
    const input = $(id);
    if (optional && input.value.trim() === "") return undefined; // the server's default
    const value = Number(input.value);
    if (!Number.isInteger(value) || value < Number(input.min) || value > Number(input.max)) {
      const label = document.querySelector(`label[for="${id}"]`).textContent;
      input.focus();
      throw new Error(`${label} must be a whole number from ${input.min} to ${input.max}`);
    }
    return value;
  }

  // A number in [min, max] (the input's bounds), or undefined when empty: the server's default.
  function optionalFraction(id) {
    const input = $(id);
    if (input.value.trim() === "") return undefined;
    const value = Number(input.value);
    if (!Number.isFinite(value) || value < Number(input.min) || value > Number(input.max)) {
      const label = document.querySelector(`label[for="${id}"]`).textContent;
      input.focus();
      throw new Error(`${label} must be a number from ${input.min} to ${input.max}`);
    }
    return value;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (busy) return; // Enter while an answer is still being written
    showError(formError, "");
    let body;
    try {
      const text = question.value.trim();
      if (!text) {
        question.focus();
        throw new Error("Type a question first.");
      }
      body = {
        question: text,
        decoding: $("decoding").value,
        retrieval: $("retrieval").value || undefined, // empty: the index's default
        k: intField("k", true), // empty: the model's n_docs (5 without one)
        num_beams: intField("num-beams"),
        max_new_tokens: intField("max-new-tokens"),
        use_cache: $("use-cache").checked,
        min_confidence: optionalFraction("min-confidence"), // empty: the server's default
        index: $("ask-index").value || undefined, // empty: the active index
      };
    } catch (err) {
      showError(formError, err.message);
      return;
    }

    busy = true;
    askButton.disabled = true;
    askButton.textContent = "Asking…";
    document.body.classList.add("is-busy");
    form.setAttribute("aria-busy", "true");
    try {
      await ask(body);
    } catch (err) {
      showError(formError, err.message);
    } finally {
      busy = false;
      askButton.disabled = false;
      askButton.textContent = "Ask";
      document.body.classList.remove("is-busy");
      form.removeAttribute("aria-busy");
    }
  });

  // Asks with "stream": true and shows the answer as it is written: the token events' text
  // (those of no passage: RAG-Sequence's per-passage drafts are not the answer) and, for
  // RAG-Token, each token's column of the heat map; then renders the answer event's body.
  // Errors before the stream began are plain HTTP errors; after it, an error event.
  async function ask(body) {
    let response;
    try {
      response = await fetch("/answer", {
        method: "POST",
        headers: withKey({ Accept: "text/event-stream, application/json", "Content-Type": "application/json" }),
        body: JSON.stringify({ ...body, stream: true }),
      });
    } catch (err) {
      throw new Error("cannot reach the gateway (" + err.message + ")");
    }
    const type = (response.headers.get("Content-Type") || "").toLowerCase();
    if (!response.ok || !type.startsWith("text/event-stream") || !response.body) {
      let data = null;
      try {
        data = await response.json();
      } catch (err) {
        data = null;
      }
      if (askForKey(response.status)) {
        keyInput.focus();
        throw new Error("this gateway needs a key: enter it in the Key field, then ask again");
      }
      if (!response.ok || !data) throw new Error(errorText(response.status, data));
      finish(data); // a plain JSON answer: a gateway that does not stream
      return;
    }

    const live = startWriting(body);
    let answered = false;
    let failed = null;
    const events = eventStream((name, text) => {
      if (answered || failed) return;
      if (name === "token") {
        live.token(JSON.parse(text));
      } else if (name === "answer") {
        answered = true;
        finish(JSON.parse(text));
      } else if (name === "error") {
        const data = JSON.parse(text);
        failed = errorText(data.status, data);
      }
    });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    try {
      for (;;) {
        let chunk;
        try {
          chunk = await reader.read();
        } catch (err) {
          throw new Error("the answer stream broke off (" + err.message + ")");
        }
        if (chunk.done) {
          events.push(decoder.decode());
          events.end();
          break;
        }
        events.push(decoder.decode(chunk.value, { stream: true }));
      }
    } catch (err) {
      reader.cancel().catch(() => {});
      if (!answered) live.stop();
      throw err;
    }
    if (answered) return;
    live.stop();
    throw new Error(failed || "the answer stream ended before the answer was complete");
  }

  function finish(data) {
    render(data);
    // An answer from the active index tells which one is active; one from an index the ask
    // form named does not.
    const askedIndex = $("ask-index").value;
    if (!askedIndex && data.index && data.index !== indexBadge.textContent) setActiveIndex(data.index, "ok");
  }

  // Enter asks; Shift+Enter is a new line.
  question.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  // ------------------------------------------------------------------ writing (streaming)

  // Clears the last answer and shows this one being written. token(t) for each token event;
  // stop() when the stream failed before its answer event (what was written stays, marked).
  function startWriting(request) {
    $("empty").hidden = true;
    result.hidden = false;
    showResult();
    document.body.classList.remove("is-busy"); // nothing old left to dim
    askButton.textContent = "Writing…";

    answerNode.textContent = "";
    answerNode.classList.remove("is-empty", "is-incomplete");
    answerNode.classList.add("is-writing");
    answerNode.setAttribute("aria-busy", "true"); // screen readers read it once it is done
    $("answer-meta").replaceChildren();
    // the confidence is known only at the end: an answer being written may still abstain
    $("abstained").hidden = true;
    $("confidence").hidden = true;
    $("other-hypotheses").hidden = true;
    $("hypotheses").replaceChildren();
    $("passages").replaceChildren();
    $("passages-pending").hidden = false;
    const heatmap = liveHeatmap(request);

    let written = 0; // tokens generated (RAG-Sequence: over every passage's draft)
    const drafts = new Set(); // RAG-Sequence: the passages whose drafts are growing
    function showStatus(text, state) {
      answerStatus.textContent = text;
      answerStatus.dataset.state = state;
      answerStatus.hidden = false;
    }
    function progress() {
      let text = "writing…";
      if (written) text += ` ${written} token${written === 1 ? "" : "s"}`;
      if (drafts.size) text += `, drafting from ${drafts.size} passage${drafts.size === 1 ? "" : "s"}`;
      showStatus(text, "writing");
    }
    progress();

    return {
      token(t) {
        const ofPassage = t.passage !== null && t.passage !== undefined;
        if (ofPassage) drafts.add(t.passage);
        else if (t.text) answerNode.textContent += t.text;
        if (t.token !== null && t.token !== undefined) {
          written += 1;
          if (!ofPassage && Array.isArray(t.posterior)) heatmap.add(t);
        }
        progress();
      },
      stop() {
        answerNode.classList.remove("is-writing");
        answerNode.classList.add("is-incomplete");
        answerNode.removeAttribute("aria-busy");
        if (!answerNode.textContent.trim()) answerNode.textContent = "(no answer)";
        $("passages-pending").hidden = true;
        showStatus("incomplete", "error");
      },
    };
  }

  const NOTE_TOKEN =
    "RAG-Token posterior over the retrieved passages for each generated token, p(z | x, y_i, y_<i), " +
    "as in Figure 2 of Lewis et al. (2020). Darker is more likely; hover a cell for its value (screen readers read each cell).";
  const NOTE_SEQUENCE =
    "Per-token posteriors exist for RAG-Token decoding only: RAG-Sequence uses one passage for the whole answer (its posterior is shown as bars above).";

  // The heat map while RAG-Token (greedy) writes: a column per token as its event arrives.
  // The passages' titles are not known yet (they come with the answer): rows are #1..#k.
  function liveHeatmap(request) {
    const table = $("heatmap");
    const note = $("heatmap-note");
    const card = $("heatmap-card");
    const scroll = table.parentElement;
    card.hidden = false;
    card.querySelector(".scale").hidden = true;
    scroll.hidden = true;
    table.hidden = true;
    table.replaceChildren();
    if (request.decoding !== "rag-token") note.textContent = NOTE_SEQUENCE;
    else if (request.num_beams > 1) note.textContent = "Beam search decides at the end: the heat map comes with the answer.";
    else note.textContent = "The heat map fills in as the answer is written: a column per token.";

    let head = null;
    let rows = [];
    let n = 0;
    return {
      add(t) {
        if (!head) {
          head = el("tr", {}, cornerCell());
          rows = t.posterior.map((_, i) => el("tr", {}, el("th", { scope: "row" }, el("span", { class: "passage-rank", text: `#${i + 1}` }))));
          table.replaceChildren(
            el("caption", { class: "visually-hidden", text: "Per-token passage posterior, as the answer is written" }),
            el("thead", {}, head),
            el("tbody", {}, ...rows)
          );
          card.querySelector(".scale").hidden = false;
          scroll.hidden = false;
          table.hidden = false;
          note.textContent = NOTE_TOKEN;
        }
        // Follow the newest column, unless the reader scrolled back to look at older ones.
        const following = scroll.scrollLeft + scroll.clientWidth >= scroll.scrollWidth - 4;
        head.append(tokenHeader(t, n));
        rows.forEach((row, i) => row.append(heatCell(t, i, `#${i + 1}`)));
        n += 1;
        if (following) scroll.scrollLeft = scroll.scrollWidth;
      },
    };
  }

  // ------------------------------------------------------------------ rendering

  // The result is laid out right under the question box (the Documents panel comes after it),
  // so it is in view when the question box is. A reader asking from elsewhere on the page has
  // its top brought into view; once there, the page is not moved again while it is written.
  function showResult() {
    const top = result.getBoundingClientRect().top;
    if (top < 0 || top > window.innerHeight - 96) result.scrollIntoView({ block: "start" });
  }

  function render(data) {
    $("empty").hidden = true;
    const shown = !result.hidden;
    result.hidden = false;
    if (!shown) showResult(); // a plain JSON answer: no startWriting before it

    const answer = answerNode;
    answer.classList.remove("is-writing", "is-incomplete");
    answer.removeAttribute("aria-busy");
    answerStatus.hidden = true;
    answerStatus.textContent = "";
    $("passages-pending").hidden = true;
    answer.classList.toggle("is-abstained", Boolean(data.abstained));
    if (data.abstained) {
      answer.textContent = "Not confident enough to answer";
      answer.classList.remove("is-empty");
    } else {
      answer.textContent = data.answer && data.answer.trim() ? data.answer : "(empty answer)";
      answer.classList.toggle("is-empty", !(data.answer && data.answer.trim()));
    }
    renderConfidence(data);

    renderMeta(data);
    // abstained: the withheld answer is listed with the others, marked as such
    renderHypotheses(data.hypotheses || [], Boolean(data.abstained));
    renderPassages(data.passages || []);
    renderHeatmap(data);
  }

  // The answer's confidence as a bar; an abstention says why plainly.
  function renderConfidence(data) {
    const box = $("confidence");
    const known = typeof data.confidence === "number" && Number.isFinite(data.confidence);
    box.hidden = !known;
    box.replaceChildren(...(known ? [bar("confidence", "Confidence", data.confidence)] : []));
    const note = $("abstained");
    note.hidden = !data.abstained;
    note.textContent = data.abstained
      ? `The model's confidence, ${pct(data.confidence)}, is below the threshold of ` +
        `${pct(data.min_confidence)}: its answer is withheld (listed below as a hypothesis).`
      : "";
  }

  function renderMeta(data) {
    const meta = $("answer-meta");
    const items = [
      ["Index", data.index],
      ["Retrieval", data.retrieval],
      ["Decoding", data.decoding],
      ["Generator", data.model_version],
      ["Retriever", data.retriever_version],
      ["Cached", data.cached ? "yes" : "no"],
    ];
    const t = data.timings_ms || {};
    if (t.total_ms !== undefined) items.push(["Total", `${Math.round(t.total_ms)} ms`]);
    if (t.retrieve_ms !== undefined) items.push(["Retrieve", `${Math.round(t.retrieve_ms)} ms`]);
    if (t.generate_ms !== undefined) items.push(["Generate", `${Math.round(t.generate_ms)} ms`]);
    meta.replaceChildren(
      ...items
        .filter(([, value]) => value !== undefined && value !== null && value !== "")
        .map(([name, value]) => el("div", {}, el("dt", { text: name }), el("dd", { text: String(value) })))
    );
  }

  function renderHypotheses(hypotheses, withBest = false) {
    const box = $("other-hypotheses");
    const shown = withBest ? hypotheses : hypotheses.slice(1);
    box.hidden = shown.length === 0;
    $("hypotheses-title").textContent = withBest ? "Hypotheses (withheld)" : "Other hypotheses";
    $("hypotheses").replaceChildren(
      ...shown.map((h) => {
        let score = `log p = ${fmt(h.log_prob, 2)}`;
        if (typeof h.confidence === "number") score += ` · confidence ${pct(h.confidence)}`;
        return el("li", {}, el("span", { text: h.text || "(empty)" }), el("span", { class: "logp", text: score }));
      })
    );
  }

  function bar(kind, label, value) {
    const missing = typeof value !== "number" || !Number.isFinite(value);
    const fill = el("div", { class: "bar-fill" });
    fill.style.width = missing ? "0" : `${Math.max(0, Math.min(1, value)) * 100}%`;
    return el(
      "div",
      {
        class: `bar-row bar-${kind}${missing ? " is-missing" : ""}`,
        role: "img",
        "aria-label": `${label}: ${missing ? "not available" : pct(value)}`,
      },
      el("span", { class: "bar-name", "aria-hidden": "true", text: label }),
      el("div", { class: "bar-track", "aria-hidden": "true" }, fill),
      el("span", { class: "bar-value", "aria-hidden": "true", text: missing ? "–" : pct(value) })
    );
  }

  function renderPassages(passages) {
    $("passages").replaceChildren(
      ...passages.map((p, i) =>
        el(
          "li",
          { class: "passage", "data-passage-id": p.id },
          el(
            "div",
            {},
            el(
              "h3",
              { class: "passage-title" },
              el("span", { class: "passage-rank", text: `#${i + 1}` }),
              el("span", { text: p.title || "(untitled)" }),
              p.page ? el("span", { class: "passage-page", text: `p. ${p.page}` }) : null
            ),
            el("p", { class: "passage-text", text: p.text }),
            el("span", { class: "passage-id", text: `${p.document && p.document !== p.id ? `${p.document} · ` : ""}${p.id} · score ${fmt(p.score, 3)}` })
          ),
          el("div", { class: "bars" }, bar("prior", "prior", p.prior), bar("posterior", "posterior", p.posterior))
        )
      )
    );
  }

  function renderHeatmap(data) {
    const table = $("heatmap");
    const note = $("heatmap-note");
    const card = $("heatmap-card");
    const best = (data.hypotheses || [])[0];
    const tokens = (best && best.tokens) || [];
    const passages = data.passages || [];
    const hasMap = tokens.length > 0 && passages.length > 0;
    card.hidden = false;
    card.querySelector(".scale").hidden = !hasMap;
    table.parentElement.hidden = !hasMap;
    if (!hasMap) {
      table.replaceChildren();
      table.hidden = true;
      note.textContent = data.decoding === "rag-token" ? "The generator returned no per-token posteriors for this answer." : NOTE_SEQUENCE;
      return;
    }
    table.hidden = false;
    note.textContent = NOTE_TOKEN;

    const caption = el("caption", { class: "visually-hidden", text: `Per-token passage posterior: ${tokens.length} tokens × ${passages.length} passages` });
    const head = el("tr", {}, cornerCell(), ...tokens.map((t, j) => tokenHeader(t, j)));
    const rows = passages.map((p, i) =>
      el(
        "tr",
        {},
        el("th", { scope: "row", title: p.title }, el("span", { class: "passage-rank", text: `#${i + 1}` }), p.title || p.id),
        ...tokens.map((t) => heatCell(t, i, `#${i + 1} ${p.title}`))
      )
    );
    table.replaceChildren(caption, el("thead", {}, head), el("tbody", {}, ...rows));
  }

  function cornerCell() {
    return el("th", { scope: "col" }, el("span", { class: "visually-hidden", text: "Passage" }));
  }

  function tokenHeader(t, j) {
    return el("th", { scope: "col", title: JSON.stringify(t.token) }, el("span", { class: "tok", text: tokenLabel(t.token) }), el("span", { class: "visually-hidden", text: ` (token ${j + 1})` }));
  }

  // Token t's posterior for passage i (named passageName in the cell's tooltip).
  function heatCell(t, i, passageName) {
    const v = Array.isArray(t.posterior) && Number.isFinite(t.posterior[i]) ? t.posterior[i] : 0;
    const cell = el("td", {
      title: `${tokenLabel(t.token)} ← ${passageName}: ${pct(v)}`,
      "aria-label": pct(v),
      "data-value": v.toFixed(4),
    });
    cell.style.backgroundColor = `rgba(var(--heat), ${Math.max(0, Math.min(1, v)).toFixed(3)})`;
    return cell;
  }

  // ------------------------------------------------------------------ swapping the index

  const dialog = $("swap-dialog");
  const swapSelect = $("swap-index");
  const tokenInput = $("admin-token");
  const swapError = $("swap-error");
  const swapSubmit = $("swap-submit");
  let adminToken = ""; // in memory only: never written to storage

  async function openSwap() {
    showError(swapError, "");
    await refreshIndexes();
    // An index the retriever cannot load is listed with the reason, and cannot be chosen.
    const usable = (ix) => ix.loadable !== false;
    const options = knownIndexes.map((ix) =>
      el(
        "option",
        { value: ix.name, disabled: !usable(ix) },
        usable(ix)
          ? `${ix.name}${ix.active ? " (active)" : ""} — ${ix.index_type}` +
            // no count to a tenant's key (the total is every tenant's)
            (Number.isFinite(ix.count) ? `, ${ix.count.toLocaleString()} passages` : "")
          : `${ix.name} — cannot be loaded: ${ix.problem}`
      )
    );
    swapSelect.replaceChildren(...options);
    // Preselect the first loadable index that is not active: the likely target.
    const target =
      knownIndexes.find((ix) => !ix.active && usable(ix)) || knownIndexes.find(usable);
    if (target) swapSelect.value = target.name;
    if (!knownIndexes.length) showError(swapError, "The retriever lists no indexes.");
    tokenInput.value = adminToken;
    dialog.showModal();
    (adminToken ? swapSelect : tokenInput).focus();
  }

  $("swap-open").addEventListener("click", openSwap);
  $("swap-cancel").addEventListener("click", () => dialog.close());

  $("swap-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(swapError, "");
    const name = swapSelect.value;
    const token = tokenInput.value.trim();
    if (!name) return showError(swapError, "Choose an index.");
    if (!token) {
      tokenInput.focus();
      return showError(swapError, "Enter the admin token.");
    }
    swapSubmit.disabled = true;
    swapSubmit.textContent = "Swapping…";
    try {
      const data = await adminCall(token, "POST", "/admin/swap-index", { index: name });
      setActiveIndex(data.active, "ok");
      afterSwap();
      dialog.close();
      $("swap-open").focus();
    } catch (err) {
      showError(swapError, err.status === 401 ? `Not allowed: ${err.message}` : err.message);
    } finally {
      swapSubmit.disabled = false;
      swapSubmit.textContent = "Swap";
    }
  });

  // ------------------------------------------------------------------ documents

  const docsIndex = $("docs-index");
  const docsFile = $("docs-file");
  const docsToken = $("docs-token");
  const docsStatus = $("docs-status");
  const docsError = $("docs-error");
  const docsList = $("docs-list");
  const docsScroll = docsList.parentElement;
  const docsRange = $("docs-range");
  const docsPrev = $("docs-prev");
  const docsNext = $("docs-next");
  const uploadButton = $("docs-upload");

  // Ids per page of the list: the documents API pages by cursor (the last id of the page
  // before), so the panel never asks for, nor draws, more than this at once.
  const DOCS_PAGE = 50;

  // The page shown: `cursor` the API's ("" the first page), `before` the cursors of the pages
  // that led here (Previous pops one), `offset` how many ids come before it (null when not
  // known: a page opened at a just-uploaded id), `next` the API's next_cursor (null: the last).
  let docsPage = { index: "", cursor: "", before: [], offset: 0, next: null, ids: [] };
  // The panel shows the active index until the reader picks another one.
  let docsFollowsActive = true;
  let docsRequest = 0; // the latest listing: an older reply arriving late is dropped

  // The admin token is asked once: by the swap dialog or here, whichever comes first.
  function docsTokenShown() {
    $("docs-token-field").hidden = Boolean(adminToken);
  }

  // An admin call with token: the token is kept once the gateway takes it and forgotten when
  // it answers 401, so that the documents panel asks for it again.
  async function adminCall(token, method, path, body) {
    try {
      const data = await api(method, path, body, { Authorization: `Bearer ${token}` });
      adminToken = token;
      return data;
    } catch (err) {
      if (err.status === 401) adminToken = "";
      throw err;
    } finally {
      docsTokenShown();
    }
  }

  function activeIndexName() {
    const active = knownIndexes.find((ix) => ix.active);
    return active ? active.name : "";
  }

  // Both selects list every index; the ask form's keeps its choice, the documents panel shows
  // the active index (GET /indexes says which) unless the reader chose another.
  function fillIndexSelects() {
    const names = knownIndexes.map((ix) => ix.name);
    const asked = $("ask-index").value;
    $("ask-index").replaceChildren(
      el("option", { value: "" }, "the active index"),
      ...names.map((name) => el("option", { value: name }, name))
    );
    if (names.includes(asked)) $("ask-index").value = asked;
    const chosen = docsIndex.value;
    docsIndex.replaceChildren(
      ...knownIndexes.map((ix) => el("option", { value: ix.name }, ix.active ? `${ix.name} (active)` : ix.name))
    );
    const active = activeIndexName();
    let target = docsFollowsActive && active ? active : chosen;
    if (!names.includes(target)) target = active || names[0];
    if (target) docsIndex.value = target;
    docsSummary();
  }

  // What GET /indexes says of the panel's index: active or not, how many passages it holds.
  function docsSummary() {
    const ix = knownIndexes.find((i) => i.name === docsIndex.value);
    const parts = [];
    if (ix) {
      parts.push(ix.active ? `${ix.name} (active)` : ix.name);
      if (Number.isFinite(ix.count)) parts.push(`${ix.count.toLocaleString("en-US")} passages`);
    }
    $("docs-summary").textContent = parts.join(" · ");
  }

  function docsPager() {
    const { ids, offset, next, before } = docsPage;
    docsPrev.disabled = before.length === 0;
    docsNext.disabled = !next;
    if (!ids.length) docsRange.textContent = "none";
    else if (offset === null) docsRange.textContent = `from ${ids[0]}`;
    else docsRange.textContent = `${offset + 1}–${offset + ids.length}`;
  }

  // Lists one page of the panel's index: the ids after `cursor`. `marked`: an id to show as
  // just uploaded, scrolled to inside the list's box.
  async function listDocuments(cursor = "", before = [], offset = 0, marked = null) {
    const index = docsIndex.value;
    const request = ++docsRequest;
    if (!index) {
      docsPage = { index, cursor: "", before: [], offset: 0, next: null, ids: [] };
      docsList.replaceChildren();
      return docsPager();
    }
    const query = new URLSearchParams({ limit: String(DOCS_PAGE) });
    if (cursor) query.set("cursor", cursor);
    try {
      const data = await api("GET", `/indexes/${encodeURIComponent(index)}/documents?${query}`);
      if (request !== docsRequest) return;
      // A page emptied by a delete: the one before it, if there is one.
      if (!data.ids.length && before.length) {
        const back = before.slice(0, -1);
        const known = back.length === 0 ? 0 : offset === null ? null : Math.max(0, offset - DOCS_PAGE);
        return listDocuments(before[before.length - 1], back, known, marked);
      }
      docsPage = { index, cursor, before, offset, next: data.next_cursor || null, ids: data.ids };
      docsList.replaceChildren(
        ...data.ids.map((id) =>
          el(
            "li",
            { "data-doc-id": id, class: id === marked ? "is-new" : null },
            el("span", { class: "doc-id", text: id }),
            id === marked ? el("span", { class: "doc-new", text: "just uploaded" }) : null,
            el("button", { type: "button", class: "btn btn-quiet doc-delete", "data-doc-id": id, "aria-label": `Delete ${id}` }, "Delete")
          )
        )
      );
      docsScroll.scrollTop = 0;
      // the list's own box scrolls to it; the page stays where it is
      const fresh = docsList.querySelector("li.is-new");
      if (fresh) docsScroll.scrollTop = Math.max(0, fresh.offsetTop - docsList.offsetTop - fresh.offsetHeight);
      docsPager();
      if (!data.ids.length && !cursor) docsStatus.textContent = `No documents in ${index} yet.`;
    } catch (err) {
      if (request !== docsRequest) return;
      docsPage = { index, cursor: "", before: [], offset: 0, next: null, ids: [] };
      docsList.replaceChildren();
      docsPager();
      docsStatus.textContent = `${index}: ${err.message}`;
    }
  }

  // The page that holds `id`: the ids after a cursor just below it. The cursor is `id` less its
  // last character (a whole code point): every id between that and `id` sorts right before it,
  // so the page starts at most a few ids early. Previous leads from there to the first page.
  // A cursor the API would refuse (blank) is the first page instead.
  function listDocumentsAt(id) {
    const cursor = Array.from(id).slice(0, -1).join("");
    if (!cursor.trim()) return listDocuments("", [], 0, id);
    return listDocuments(cursor, [""], null, id);
  }

  docsNext.addEventListener("click", () => {
    const { cursor, before, offset, ids, next } = docsPage;
    if (!next) return;
    docsStatus.textContent = "";
    listDocuments(next, [...before, cursor], offset === null ? null : offset + ids.length);
  });

  docsPrev.addEventListener("click", () => {
    const { before, offset } = docsPage;
    if (!before.length) return;
    docsStatus.textContent = "";
    const back = before.slice(0, -1);
    // Back on the first page the offset is known again (0); a page before one opened at an
    // upload is the first page (listDocumentsAt).
    listDocuments(before[before.length - 1], back, back.length === 0 ? 0 : offset === null ? null : Math.max(0, offset - DOCS_PAGE));
  });

  // The token of a write from the documents panel: the one kept, else the panel's field.
  function writeToken() {
    const token = adminToken || docsToken.value.trim();
    if (!token) throw new Error("Give the admin token first.");
    return token;
  }

  $("upload-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    showError(docsError, "");
    const file = docsFile.files && docsFile.files[0];
    const index = docsIndex.value;
    try {
      if (!index) throw new Error("Choose an index.");
      if (!file) throw new Error("Choose a file to upload.");
      const token = writeToken();
      uploadButton.disabled = true;
      docsStatus.textContent = `Uploading ${file.name}…`;
      const formData = new FormData();
      formData.append("file", file, file.name);
      const data = await adminCall(token, "POST", `/indexes/${encodeURIComponent(index)}/documents`, formData);
      $("ask-index").value = index; // ask about it next
      docsFile.value = "";
      // Its id may sort anywhere: show the page that holds it, marked, whatever page was shown.
      await listDocumentsAt(data.id);
      refreshIndexes().then(docsSummary); // its passages in the count
      const pages = data.pages ? `, ${data.pages} pages` : "";
      docsStatus.textContent = `Uploaded "${data.title}" (${data.type}${pages}) as ${data.id}: ${data.passages} passages.`;
    } catch (err) {
      docsStatus.textContent = "";
      showError(docsError, err.message);
    } finally {
      uploadButton.disabled = false;
    }
  });

  docsList.addEventListener("click", async (event) => {
    const button = event.target.closest(".doc-delete");
    if (!button) return;
    showError(docsError, "");
    const id = button.dataset.docId;
    try {
      const token = writeToken();
      await adminCall(token, "DELETE", `/indexes/${encodeURIComponent(docsIndex.value)}/documents/${encodeURIComponent(id)}`);
      // The same page again, less the id (or the page before, where it was the last one).
      const { cursor, before, offset } = docsPage;
      await listDocuments(cursor, before, offset);
      refreshIndexes().then(docsSummary);
      docsStatus.textContent = `Deleted ${id}.`;
    } catch (err) {
      showError(docsError, err.message);
    }
  });

  docsIndex.addEventListener("change", () => {
    docsFollowsActive = docsIndex.value === activeIndexName();
    docsStatus.textContent = "";
    docsSummary();
    listDocuments();
  });

  // After a swap the panel follows the new active index, unless the reader chose another.
  async function afterSwap() {
    const shown = docsIndex.value;
    await refreshIndexes();
    fillIndexSelects();
    if (docsIndex.value !== shown) {
      docsStatus.textContent = "";
      listDocuments();
    }
  }

  refreshIndexes().then(() => {
    fillIndexSelects();
    docsTokenShown();
    listDocuments();
  });
})();
