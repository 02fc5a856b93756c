// openbook web page: ask a question, show the answer, the passages and where each token came
// from. Vanilla JS, no dependencies. Text from the API is only ever set with textContent.
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

  async function api(method, path, body, headers) {
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: { Accept: "application/json", ...(body ? { "Content-Type": "application/json" } : {}), ...headers },
        body: body ? JSON.stringify(body) : undefined,
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
      const error = new Error(errorText(response.status, data));
      error.status = response.status;
      throw error;
    }
    return data;
  }

  function showError(node, message) {
    node.textContent = message || "";
    node.hidden = !message;
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

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
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
        k: intField("k", true), // empty: the model's n_docs (5 without one)
        num_beams: intField("num-beams"),
        max_new_tokens: intField("max-new-tokens"),
        use_cache: $("use-cache").checked,
      };
    } catch (err) {
      showError(formError, err.message);
      return;
    }

    askButton.disabled = true;
    askButton.textContent = "Asking…";
    document.body.classList.add("is-busy");
    form.setAttribute("aria-busy", "true");
    try {
      const data = await api("POST", "/answer", body);
      render(data);
      if (data.index && data.index !== indexBadge.textContent) setActiveIndex(data.index, "ok");
    } catch (err) {
      showError(formError, err.message);
    } finally {
      askButton.disabled = false;
      askButton.textContent = "Ask";
      document.body.classList.remove("is-busy");
      form.removeAttribute("aria-busy");
    }
  });

  // Enter asks; Shift+Enter is a new line.
  question.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });

  // ------------------------------------------------------------------ rendering

  function render(data) {
    $("empty").hidden = true;
    result.hidden = false;

    const answer = $("answer");
    answer.textContent = data.answer && data.answer.trim() ? data.answer : "(empty answer)";
    answer.classList.toggle("is-empty", !(data.answer && data.answer.trim()));

    renderMeta(data);
    renderHypotheses(data.hypotheses || []);
    renderPassages(data.passages || []);
    renderHeatmap(data);
  }

  function renderMeta(data) {
    const meta = $("answer-meta");
    const items = [
      ["Index", data.index],
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

  function renderHypotheses(hypotheses) {
    const box = $("other-hypotheses");
    const rest = hypotheses.slice(1);
    box.hidden = rest.length === 0;
    $("hypotheses").replaceChildren(
      ...rest.map((h) =>
        el("li", {}, el("span", { text: h.text || "(empty)" }), el("span", { class: "logp", text: `log p = ${fmt(h.log_prob, 2)}` }))
      )
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
            el("h3", { class: "passage-title" }, el("span", { class: "passage-rank", text: `#${i + 1}` }), el("span", { text: p.title || "(untitled)" })),
            el("p", { class: "passage-text", text: p.text }),
            el("span", { class: "passage-id", text: `${p.id} · score ${fmt(p.score, 3)}` })
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
      note.textContent =
        data.decoding === "rag-token"
          ? "The generator returned no per-token posteriors for this answer."
          : "Per-token posteriors exist for RAG-Token decoding only: RAG-Sequence uses one passage for the whole answer (its posterior is shown as bars above).";
      return;
    }
    table.hidden = false;
    note.textContent =
      "RAG-Token posterior over the retrieved passages for each generated token, p(z | x, y_i, y_<i), " +
      "as in Figure 2 of Lewis et al. (2020). Darker is more likely; hover a cell for its value (screen readers read each cell).";

    const caption = el("caption", { class: "visually-hidden", text: `Per-token passage posterior: ${tokens.length} tokens × ${passages.length} passages` });
    const head = el(
      "tr",
      {},
      el("th", { scope: "col" }, el("span", { class: "visually-hidden", text: "Passage" })),
      ...tokens.map((t, j) =>
        el("th", { scope: "col", title: JSON.stringify(t.token) }, el("span", { class: "tok", text: tokenLabel(t.token) }), el("span", { class: "visually-hidden", text: ` (token ${j + 1})` }))
      )
    );
    const rows = passages.map((p, i) =>
      el(
        "tr",
        {},
        el("th", { scope: "row", title: p.title }, el("span", { class: "passage-rank", text: `#${i + 1}` }), p.title || p.id),
        ...tokens.map((t) => {
          const v = Array.isArray(t.posterior) && Number.isFinite(t.posterior[i]) ? t.posterior[i] : 0;
          const cell = el("td", {
            title: `${tokenLabel(t.token)} ← #${i + 1} ${p.title}: ${pct(v)}`,
            "aria-label": pct(v),
            "data-value": v.toFixed(4),
          });
          cell.style.backgroundColor = `rgba(var(--heat), ${Math.max(0, Math.min(1, v)).toFixed(3)})`;
          return cell;
        })
      )
    );
    table.replaceChildren(caption, el("thead", {}, head), el("tbody", {}, ...rows));
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
    const options = knownIndexes.map((ix) =>
      el(
        "option",
        { value: ix.name },
        `${ix.name}${ix.active ? " (active)" : ""} — ${ix.index_type}, ${ix.count.toLocaleString()} passages`
      )
    );
    swapSelect.replaceChildren(...options);
    // Preselect the first index that is not active: the likely target.
    const target = knownIndexes.find((ix) => !ix.active) || knownIndexes[0];
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
      const data = await api("POST", "/admin/swap-index", { index: name }, { Authorization: `Bearer ${token}` });
      adminToken = token;
      setActiveIndex(data.active, "ok");
      dialog.close();
      $("swap-open").focus();
    } catch (err) {
      if (err.status === 401) adminToken = "";
      showError(swapError, err.status === 401 ? `Not allowed: ${err.message}` : err.message);
    } finally {
      swapSubmit.disabled = false;
      swapSubmit.textContent = "Swap";
    }
  });

  refreshIndexes();
})();
