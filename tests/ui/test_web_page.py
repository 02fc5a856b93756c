"""The web page end to end in headless Chromium, over a live gateway and real backends.

Ask with RAG-Token and k=3 and watch the answer being written (the page asks with
``"stream": true``): the answer text and the per-token heat map grow token by token, then the
answer, the passages with prior/posterior bars and the heat map are those of the ``answer``
event. Swap the index with the admin token, see the label change. Errors before and during the
stream are shown. Upload a PDF into an index from the Documents panel (the admin token asked
once), see it listed, ask about it (its passage names its page), delete it. Over an active
index of more than 1,000 documents at 1280×900: the answer is drawn in view, right under the
question box; the Documents panel shows the active index 50 ids a page, and an upload whose id
sorts past the first 1,000 is listed as soon as it is done. Screenshots (one
mid-stream) go to ``artifacts/`` (kept by CI). Needs Debian's ``chromium`` and
``chromium-driver`` and the ``selenium`` package (``scripts/install-browser.sh``); without
them the test is skipped, or fails where ``OPENBOOK_REQUIRE_BROWSER=1`` says the browser must
be there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from openbook_testkit.sse import read_events
from openbook_testkit.stack import running_backends, serving_gateway

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("OPENBOOK_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("OPENBOOK_CHROMEDRIVER", "/usr/bin/chromedriver")
TOKEN = "ui-admin-token"
WAIT_S = 30
MANY = "wiki-many"  # an index of more documents than the page once listed (the fixture's)
MANY_DOCS = 1_201
NEW_TOKENS = 16  # the tiny random BART writes every one of them: several token events

# Watches the page write its answer. Every DOM change is a mutation record, however many
# events one network chunk brought, and the observer gets them in order: __timeline has, per
# change, the answer's text after it (a text node, never changed once written) and how many
# heat-map cells had been appended one by one so far; __states what the page looked like
# whenever the observer ran (answer text, cell count, being written, Ask disabled).
WATCH_JS = """
const answer = document.getElementById("answer");
const heatmap = document.getElementById("heatmap");
const button = document.getElementById("ask-button");
let text = answer.textContent;
let cells = 0;
Object.assign(window, { __timeline: [], __states: [] });
window.__observer = new MutationObserver((records) => {
  for (const r of records) {
    if (r.type !== "childList") continue;
    if (r.target === answer) {
      text = [...r.addedNodes].map((n) => n.textContent).join("");
    } else if (r.target.nodeName === "TR") {  // a heat-map row, maybe replaced since
      const added = [...r.addedNodes].filter((n) => n.nodeName === "TD").length;
      if (!added) continue;
      cells += added;
    } else {
      continue;
    }
    window.__timeline.push({ text, cells });
  }
  window.__states.push({
    text: answer.textContent,
    cells: heatmap.querySelectorAll("td").length,
    writing: answer.classList.contains("is-writing"),
    disabled: button.disabled,
  });
});
window.__observer.observe(document.getElementById("result"), {
  subtree: true, childList: true, characterData: true, attributes: true,
});
"""

# Wraps fetch: POST /answer's body reaches the page in 7-byte pieces (events and lines split
# across chunks), and stops after the first 8 events until window.__gate.release().
GATE_JS = """
const realFetch = window.__realFetch || window.fetch;
window.__realFetch = realFetch;
window.__gate = { paused: false };
window.fetch = async (...args) => {
  const response = await realFetch(...args);
  if (!String(args[0]).endsWith("/answer") || !response.body) return response;
  const gate = new Promise((resolve) => { window.__gate.release = resolve; });
  const reader = response.body.getReader();
  let events = 0;
  let previous = 0;
  const body = new ReadableStream({
    async pull(controller) {
      const { done, value } = await reader.read();
      if (done) return controller.close();
      for (let i = 0; i < value.length; i += 7) {
        const piece = value.slice(i, i + 7);
        controller.enqueue(piece);
        for (const byte of piece) {
          if (byte === 10 && previous === 10 && ++events === 8) {
            window.__gate.paused = true;
            await gate;
            window.__gate.paused = false;
          }
          previous = byte;
        }
      }
    },
  });
  return new Response(body, { status: response.status, headers: response.headers });
};
"""

# Replaces fetch for POST /answer with one canned reply: (status, content type, body).
CANNED_JS = """
const [status, type, text] = arguments;
window.__realFetch = window.__realFetch || window.fetch;
window.fetch = async (url, init) =>
  String(url).endsWith("/answer")
    ? new Response(text, { status, headers: { "Content-Type": type } })
    : window.__realFetch(url, init);
"""


def _browser_missing() -> str | None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return (
            f"{', '.join(missing)} not found: run scripts/install-browser.sh "
            "(Debian packages chromium and chromium-driver)"
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "python package selenium not installed: run scripts/install-browser.sh"
    return None


@pytest.fixture(scope="module")
def driver():
    reason = _browser_missing()
    if reason:
        if os.environ.get("OPENBOOK_REQUIRE_BROWSER") == "1":
            pytest.fail(f"OPENBOOK_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(f"browser test skipped: {reason}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download a thing
    profile = tempfile.mkdtemp(prefix="openbook-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
        "--force-device-scale-factor=1",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    browser.set_page_load_timeout(WAIT_S)
    yield browser
    browser.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, redis_server):
    redis_server.flush()
    workdir = tmp_path_factory.mktemp("ui")
    _build_many_documents_index(workdir / "indexes")
    with running_backends(workdir, redis_server.url, admin_token=TOKEN) as backends:
        settings = backends.gateway_settings(redis_server.url, admin_token=TOKEN)
        with serving_gateway(settings, timeout_s=WAIT_S) as url:
            yield url
    redis_server.flush()  # leave no active index behind for other modules


def _build_many_documents_index(root: Path) -> None:
    """``MANY``: a BM25 index of ``MANY_DOCS`` one-passage documents, ``doc-00000`` on. More
    than the 1,000 ids the page once listed in one go, above the ask form's answer; ids that sort
    before an upload's ``sha256-...``, so an upload lands past the first 1,000."""
    from openbook.index import build_index
    from openbook.index.spec import BuildOptions, IndexSpec
    from openbook_testkit.index import random_rows, write_jsonl

    rows = [
        {**row, "id": f"doc-{i:05d}", "title": f"Document {i}"}
        for i, row in enumerate(random_rows(MANY_DOCS, words=12, seed=7))
    ]
    source = write_jsonl(root / f"{MANY}.jsonl", rows)
    build_index(
        [source], root / MANY, IndexSpec(name=MANY, index_type="bm25"), BuildOptions(progress=False)
    )


def _screenshot(driver, name: str, width: int = 1280) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    # The whole page: grow the window until nothing is left below the fold.
    for _ in range(3):
        driver.set_window_size(width, 1000)
        inner = driver.execute_script("return window.innerHeight")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(width, min(int(height) + (1000 - int(inner)), 5000))
        driver.execute_script("window.scrollTo(0, 0)")
        if driver.execute_script(
            "return document.documentElement.scrollHeight <= window.innerHeight"
        ):
            break
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), f"could not save {path}"
    return path


def _answered(driver) -> bool:
    """The page is done with its request: Ask is back and no answer is being written."""
    return driver.execute_script(
        "const b = document.getElementById('ask-button');"
        "return !b.disabled && b.textContent === 'Ask'"
        " && !document.getElementById('answer').classList.contains('is-writing')"
    )


def _heatmap_values(driver) -> list[list[float]]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#heatmap tbody tr')].map("
        "r => [...r.querySelectorAll('td')].map(c => parseFloat(c.dataset.value)))"
    )


def _answer_event(url: str, body: dict) -> dict:
    """The ``answer`` event of the same request, asked outside the browser."""
    with httpx.stream("POST", f"{url}/answer", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = list(read_events(r.iter_lines()))
    assert events[-1].event == "answer"
    return events[-1].json()


def test_ask_see_answer_and_heatmap_then_swap_index(driver, gateway_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    driver.get(gateway_url + "/")
    assert "openbook" in driver.title
    badge = driver.find_element(By.ID, "active-index")
    wait.until(lambda d: badge.text == "facts-a")
    # the Documents panel shows the active index's documents (all 30 on one page)
    docs_index = driver.find_element(By.ID, "docs-index")
    assert docs_index.get_attribute("value") == "facts-a"
    wait.until(lambda d: len(_listed(d)) == 30 and _listed(d)[0] == "p00")

    # --- ask: question, RAG-Token, k = 3, 16 tokens; watch the answer being written
    question = driver.find_element(By.ID, "question")
    question.send_keys("Who wrote Hamlet?")
    Select(driver.find_element(By.ID, "decoding")).select_by_value("rag-token")
    k = driver.find_element(By.ID, "k")
    k.clear()
    k.send_keys("3")
    max_tokens = driver.find_element(By.ID, "max-new-tokens")
    max_tokens.clear()
    max_tokens.send_keys(str(NEW_TOKENS))
    driver.execute_script(WATCH_JS)
    ask = driver.find_element(By.ID, "ask-button")
    ask.click()
    assert not ask.is_enabled()  # off from the click until the answer is done
    wait.until(_answered)
    watched = driver.execute_script(
        "window.__observer.disconnect();"
        "return {timeline: window.__timeline, states: window.__states}"
    )

    answer = driver.find_element(By.ID, "answer")
    assert answer.get_attribute("aria-live") == "polite"
    assert answer.get_attribute("aria-busy") is None
    assert answer.text.strip()
    assert driver.find_element(By.ID, "form-error").get_attribute("hidden") is not None
    assert not driver.find_element(By.ID, "answer-status").is_displayed()
    assert not driver.find_element(By.ID, "passages-pending").is_displayed()

    # the page shows what the answer event says (the same request again: the cached answer)
    asked = {
        "question": "Who wrote Hamlet?",
        "decoding": "rag-token",
        "k": 3,
        "num_beams": 1,
        "max_new_tokens": NEW_TOKENS,
        "use_cache": True,
    }
    event = _answer_event(gateway_url, asked)
    assert event["cached"] is True  # the page asked exactly this
    final = event["answer"]
    best = event["hypotheses"][0]["tokens"]
    assert len(best) == NEW_TOKENS
    assert driver.execute_script("return document.getElementById('answer').textContent") == final

    # it was written token by token, while Ask stayed off: the answer's text grew through
    # prefixes of the answer, the heat map cell by cell (3 passages per token), in step
    states = watched["states"]
    writing = [s for s in states if s["writing"]]
    assert writing and all(s["disabled"] for s in writing)
    assert states[-1]["text"] == final and not states[-1]["writing"]
    assert states[-1]["cells"] == 3 * NEW_TOKENS
    timeline = watched["timeline"]
    texts = list(dict.fromkeys(t["text"] for t in timeline if t["text"]))
    assert texts[-1] == final and all(final.startswith(t) for t in texts), (texts, final)
    assert [len(t) for t in texts] == sorted({len(t) for t in texts}), texts
    assert len(texts) - 1 >= 2, texts  # intermediate states before the final one
    cells = [t["cells"] for t in timeline]
    assert cells == sorted(cells) and cells[-1] == 3 * NEW_TOKENS, cells  # appended, one by one
    assert len(set(cells)) == 3 * NEW_TOKENS + (0 in cells), cells
    # the text changed while the heat map was growing, not all before or after it
    while_growing = {t["text"] for t in timeline if 0 < t["cells"] < 3 * NEW_TOKENS}
    assert len(while_growing) >= 3, timeline

    passages = driver.find_elements(By.CSS_SELECTOR, "#passages > li.passage")
    assert len(passages) == 3
    assert passages[0].get_attribute("data-passage-id") == "p21"
    for p in passages:
        assert p.find_element(By.CSS_SELECTOR, ".passage-title").text.strip()
        for kind in ("prior", "posterior"):
            bar = p.find_element(By.CSS_SELECTOR, f".bar-{kind}")
            assert bar.get_attribute("aria-label").startswith(f"{kind}: ")
            assert bar.get_attribute("aria-label").endswith("%"), bar.get_attribute("aria-label")
            width = p.find_element(By.CSS_SELECTOR, f".bar-{kind} .bar-fill").size["width"]
            assert width >= 1
    priors = driver.execute_script(
        "return [...document.querySelectorAll('.bar-prior')].map(b => b.getAttribute('aria-label'))"
    )
    assert len(priors) == 3

    # --- heat map: passages × tokens, each token's column a distribution over the passages
    heatmap = driver.find_element(By.ID, "heatmap")
    assert heatmap.is_displayed()
    rows = heatmap.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) == 3
    n_tokens = len(heatmap.find_elements(By.CSS_SELECTOR, "thead th")) - 1
    assert n_tokens >= 1
    values = driver.execute_script(
        "return [...document.querySelectorAll('#heatmap tbody tr')].map("
        "r => [...r.querySelectorAll('td')].map(c => parseFloat(c.dataset.value)))"
    )
    assert all(len(row) == n_tokens for row in values)
    for j in range(n_tokens):
        assert sum(row[j] for row in values) == pytest.approx(1.0, abs=0.01)
    assert n_tokens == len(best)
    for j, token in enumerate(best):
        assert [row[j] for row in values] == pytest.approx(token["posterior"], abs=1e-4)
    assert [p.get_attribute("data-passage-id") for p in passages] == [
        p["id"] for p in event["passages"]
    ]

    shot = _screenshot(driver, "ui-answer.png")
    assert shot.stat().st_size > 10_000

    # --- mid-stream: the body in small pieces, held after 8 events (not from the cache)
    driver.set_window_size(1280, 1000)
    driver.find_element(By.ID, "use-cache").click()
    driver.execute_script(GATE_JS)
    ask.click()
    wait.until(lambda d: d.execute_script("return window.__gate.paused"))
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#heatmap td")) == 3 * 8)
    assert not ask.is_enabled() and ask.text == "Writing…"
    assert "is-writing" in answer.get_attribute("class")
    assert answer.get_attribute("aria-busy") == "true"
    status = driver.find_element(By.ID, "answer-status")
    assert status.is_displayed() and status.text.startswith("writing…"), status.text
    assert "8 tokens" in status.text
    assert answer.text.strip() and final.startswith(answer.text.strip())
    assert answer.text.strip() != final.strip()
    assert driver.find_element(By.ID, "passages-pending").is_displayed()
    assert not driver.find_elements(By.CSS_SELECTOR, "#passages > li")
    assert heatmap.is_displayed()
    assert [r.text for r in heatmap.find_elements(By.CSS_SELECTOR, "tbody th")] == [
        "#1",
        "#2",
        "#3",
    ]
    assert _heatmap_values(driver) == [row[:8] for row in values]
    _screenshot(driver, "ui-writing.png")
    driver.set_window_size(1280, 1000)

    driver.execute_script("window.__gate.release()")
    wait.until(_answered)
    assert driver.execute_script("return document.getElementById('answer').textContent") == final
    assert _heatmap_values(driver) == values
    assert len(driver.find_elements(By.CSS_SELECTOR, "#passages > li.passage")) == 3
    meta = driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#answer-meta div')]"
        ".map(d => [d.firstChild.textContent, d.lastChild.textContent]))"
    )
    assert meta["Cached"] == "no" and meta["Decoding"] == "rag-token"
    driver.execute_script("window.fetch = window.__realFetch")
    driver.find_element(By.ID, "use-cache").click()

    # --- swap: a wrong token is refused and says so; the right one swaps
    driver.set_window_size(1280, 1000)
    driver.find_element(By.ID, "swap-open").click()
    dialog = driver.find_element(By.ID, "swap-dialog")
    wait.until(lambda d: dialog.get_attribute("open") is not None)
    options = [
        o.get_attribute("value")
        for o in driver.find_elements(By.CSS_SELECTOR, "#swap-index option")
    ]
    assert set(options) == {"facts-a", "facts-b", MANY}
    Select(driver.find_element(By.ID, "swap-index")).select_by_value("facts-b")
    token = driver.find_element(By.ID, "admin-token")
    assert token.get_attribute("type") == "password"
    token.send_keys("wrong-token")
    driver.find_element(By.ID, "swap-submit").click()
    error = driver.find_element(By.ID, "swap-error")
    wait.until(lambda d: error.is_displayed())
    assert "Not allowed" in error.text
    assert badge.text == "facts-a"

    token.clear()
    token.send_keys(TOKEN + Keys.ENTER)
    wait.until(lambda d: badge.text == "facts-b")
    assert dialog.get_attribute("open") is None
    # the Documents panel follows the swap (the reader never chose another index there)
    wait.until(lambda d: docs_index.get_attribute("value") == "facts-b")
    wait.until(lambda d: _listed(d)[:1] == ["b-p00"])

    # --- the next answer comes from the new index
    driver.find_element(By.ID, "ask-button").click()
    wait.until(_answered)
    wait.until(
        lambda d: (
            d.find_element(By.CSS_SELECTOR, "#passages > li.passage")
            .get_attribute("data-passage-id")
            .startswith("b-")
        )
    )
    _screenshot(driver, "ui-swapped.png")

    # --- RAG-Sequence: no per-token heat map, and the page says why
    Select(driver.find_element(By.ID, "decoding")).select_by_value("rag-sequence-fast")
    driver.find_element(By.ID, "ask-button").click()
    wait.until(_answered)
    assert not driver.find_element(By.ID, "heatmap").is_displayed()
    assert "RAG-Token" in driver.find_element(By.ID, "heatmap-note").text
    assert driver.find_element(By.ID, "answer").text.strip()
    assert len(driver.find_elements(By.CSS_SELECTOR, "#passages > li.passage")) == 3

    # --- narrow screen: still usable
    driver.set_window_size(390, 900)
    assert driver.find_element(By.ID, "ask-button").is_displayed()
    _screenshot(driver, "ui-mobile.png", width=390)


def test_errors_before_and_during_the_stream_are_shown(driver, gateway_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(1280, 1000)
    driver.get(gateway_url + "/")
    driver.find_element(By.ID, "question").send_keys("Who wrote Hamlet?")
    ask = driver.find_element(By.ID, "ask-button")
    error = driver.find_element(By.ID, "form-error")
    answer = driver.find_element(By.ID, "answer")
    token = '{"text":" Shakes","token":"\\u0120Shakes","passage":null,"posterior":[0.9,0.1]}'

    def reply(status: int, content_type: str, body: str) -> str:
        driver.execute_script(CANNED_JS, status, content_type, body)
        ask.click()
        wait.until(_answered)
        wait.until(lambda d: error.is_displayed())
        return error.text

    # before the stream: a plain HTTP error, shown as the page always did
    assert (
        reply(503, "application/json", '{"detail": "generator unavailable"}')
        == "generator unavailable"
    )
    assert not driver.find_element(By.ID, "result").is_displayed()

    # during it: an error event; what was written stays, marked incomplete
    stream = f"event: token\ndata: {token}\n\n" + (
        'event: error\ndata: {"status":504,"detail":"generation timed out","request_id":"r1"}\n\n'
    )
    assert reply(200, "text/event-stream", stream) == "generation timed out"
    assert answer.text == "Shakes"
    assert "is-incomplete" in answer.get_attribute("class")
    assert answer.get_attribute("aria-busy") is None
    assert driver.find_element(By.ID, "answer-status").text == "incomplete"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#heatmap td")) == 2

    # a stream that ends without its answer event
    assert "ended before the answer was complete" in reply(
        200, "text/event-stream", f"event: token\ndata: {token}\n\n"
    )
    _screenshot(driver, "ui-stream-error.png")
    driver.execute_script("window.fetch = window.__realFetch")


def test_the_confidence_and_an_abstention_are_shown(driver, gateway_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    driver.set_window_size(1280, 1000)
    driver.get(gateway_url + "/")
    driver.find_element(By.ID, "question").send_keys("Who wrote Hamlet?")
    threshold = driver.find_element(By.ID, "min-confidence")
    ask = driver.find_element(By.ID, "ask-button")
    answer = driver.find_element(By.ID, "answer")
    note = driver.find_element(By.ID, "abstained")

    # a threshold no answer of the tiny random model clears: the page says so plainly
    threshold.send_keys("1")
    ask.click()
    wait.until(_answered)
    assert answer.text == "Not confident enough to answer"
    assert note.is_displayed() and "below the threshold of 100%" in note.text, note.text
    bar = driver.find_element(By.CSS_SELECTOR, "#confidence .bar-confidence")
    assert bar.get_attribute("aria-label").startswith("Confidence: ")
    assert driver.find_element(By.ID, "hypotheses-title").text == "Hypotheses (withheld)"
    withheld = driver.find_elements(By.CSS_SELECTOR, "#hypotheses > li")
    assert len(withheld) == 1 and "confidence" in withheld[0].text
    assert len(driver.find_elements(By.CSS_SELECTOR, "#passages > li.passage")) >= 1
    _screenshot(driver, "ui-abstained.png")
    driver.set_window_size(1280, 1000)

    # no threshold: the answer, with its confidence
    threshold.clear()
    ask.click()
    wait.until(_answered)
    wait.until(lambda d: not note.is_displayed())
    assert answer.text.strip() and answer.text != "Not confident enough to answer"
    assert driver.find_element(By.ID, "confidence").is_displayed()

    # a threshold outside [0, 1] is refused before asking
    threshold.send_keys("2")
    ask.click()
    error = driver.find_element(By.ID, "form-error")
    wait.until(lambda d: error.is_displayed())
    assert error.text == "Min. confidence must be a number from 0 to 1"


def test_upload_a_file_see_it_ask_about_it_and_delete_it(driver, gateway_url, tmp_path):
    """The Documents panel: a PDF uploaded into a new index (the admin token asked once),
    listed, asked about (its passage shows its page), deleted."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from openbook_testkit import files

    wait = WebDriverWait(driver, WAIT_S)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    created = httpx.post(
        f"{gateway_url}/indexes", json={"name": "uploads", "like": "facts-a"}, headers=auth
    )
    assert created.status_code == 201, created.text
    pages = [files.sentences(n, 60) for n in (1, 2)]
    pages[1] = "The zorblax turbine of the quay spins at dawn. " + pages[1]
    pdf = tmp_path / "quay.pdf"
    pdf.write_bytes(files.pdf_bytes(pages, title="Quay report"))

    driver.set_window_size(1280, 1000)
    driver.get(gateway_url + "/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#docs-index option[value=uploads]"))
    Select(driver.find_element(By.ID, "docs-index")).select_by_value("uploads")
    status = driver.find_element(By.ID, "docs-status")
    wait.until(lambda d: "No documents in uploads" in status.text)
    driver.find_element(By.ID, "docs-file").send_keys(str(pdf))
    token_field = driver.find_element(By.ID, "docs-token-field")
    assert token_field.is_displayed()
    driver.find_element(By.ID, "docs-token").send_keys(TOKEN)
    driver.find_element(By.ID, "docs-upload").click()
    wait.until(lambda d: status.text.startswith("Uploaded"))
    assert '"Quay report" (pdf, 2 pages)' in status.text, status.text
    assert not token_field.is_displayed()  # asked once: kept in the page's memory
    listed = driver.find_elements(By.CSS_SELECTOR, "#docs-list li")
    assert len(listed) == 1
    doc_id = listed[0].get_attribute("data-doc-id")
    assert doc_id.startswith("sha256-")

    # ask about it: the ask form now asks the index the file went to
    assert Select(driver.find_element(By.ID, "ask-index")).first_selected_option.text == "uploads"
    question = driver.find_element(By.ID, "question")
    question.clear()
    question.send_keys("zorblax turbine quay")
    Select(driver.find_element(By.ID, "retrieval")).select_by_value("bm25")
    max_tokens = driver.find_element(By.ID, "max-new-tokens")
    max_tokens.clear()
    max_tokens.send_keys("4")
    driver.find_element(By.ID, "ask-button").click()
    wait.until(_answered)
    first = driver.find_element(By.CSS_SELECTOR, "#passages > li.passage")
    assert first.get_attribute("data-passage-id").startswith(f"{doc_id}#")
    assert "Quay report" in first.find_element(By.CSS_SELECTOR, ".passage-title").text
    assert first.find_element(By.CSS_SELECTOR, ".passage-page").text == "p. 2"
    _screenshot(driver, "ui-documents.png")
    badge = driver.find_element(By.ID, "active-index").text
    assert badge != "uploads"  # an answer from a named index does not make it the active one

    # delete it: gone from the list and from the index
    driver.find_element(By.CSS_SELECTOR, f'#docs-list button[data-doc-id="{doc_id}"]').click()
    wait.until(lambda d: status.text == f"Deleted {doc_id}.")
    assert not driver.find_elements(By.CSS_SELECTOR, "#docs-list li")
    gone = httpx.get(f"{gateway_url}/indexes/uploads/documents/{doc_id}")
    assert gone.status_code == 404
    assert httpx.delete(f"{gateway_url}/indexes/uploads", headers=auth).status_code == 200


def _listed(driver) -> list[str]:
    """The document ids the Documents panel lists, in order."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#docs-list > li')].map(li => li.dataset.docId)"
    )


def test_the_answer_is_in_view_and_the_documents_are_paged(driver, gateway_url, tmp_path):
    """Over an active index of more documents than the page once listed (1,201), at 1280×900:
    after Ask, the answer and its first passage are drawn right under the question box, with no
    scrolling; the Documents panel shows the active index, a page of 50 ids at a time, with next
    and previous; a file uploaded into it (its id past the first 1,000) is listed, marked, as
    soon as the upload is done."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    was_active = httpx.get(f"{gateway_url}/indexes").json()["active"]
    swapped = httpx.post(f"{gateway_url}/admin/swap-index", json={"index": MANY}, headers=auth)
    assert swapped.status_code == 200, swapped.text
    try:
        driver.set_window_size(1280, 900)
        driver.get(gateway_url + "/")
        badge = driver.find_element(By.ID, "active-index")
        wait.until(lambda d: badge.text == MANY)

        # --- ask: the answer and its passages where the question was asked, not 50,000 px down
        driver.find_element(By.ID, "question").send_keys("w1 w2 w3 w4")
        max_tokens = driver.find_element(By.ID, "max-new-tokens")
        max_tokens.clear()
        max_tokens.send_keys("4")
        driver.find_element(By.ID, "ask-button").click()
        wait.until(_answered)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#passages > li.passage"))
        seen = driver.execute_script(
            "const top = (el) => el.getBoundingClientRect().top;"
            "return {result: top(document.getElementById('result')),"
            " answer: document.getElementById('answer').getBoundingClientRect().bottom,"
            " passage: top(document.querySelector('#passages > li.passage')),"
            " height: window.innerHeight, scrolled: window.scrollY}"
        )
        ARTIFACTS.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(ARTIFACTS / "ui-answer-in-view.png"))  # the viewport
        assert 0 < seen["height"] <= 900, seen
        assert 0 <= seen["result"] < seen["height"], seen
        assert seen["answer"] < seen["height"], seen
        assert seen["passage"] < seen["height"], seen
        assert seen["scrolled"] == 0, seen  # drawn there, not scrolled to

        # --- the Documents panel: the active index, 50 ids a page, next and previous
        docs_index = Select(driver.find_element(By.ID, "docs-index"))
        assert docs_index.first_selected_option.get_attribute("value") == MANY
        summary = driver.find_element(By.ID, "docs-summary")
        assert f"{MANY_DOCS:,} passages" in summary.text, summary.text
        page = [f"doc-{i:05d}" for i in range(MANY_DOCS)]
        wait.until(lambda d: _listed(d) == page[:50])
        shown = driver.find_element(By.ID, "docs-range")
        previous = driver.find_element(By.ID, "docs-prev")
        following = driver.find_element(By.ID, "docs-next")
        assert shown.text == "1–50" and not previous.is_enabled() and following.is_enabled()
        following.click()
        wait.until(lambda d: _listed(d) == page[50:100])
        assert shown.text == "51–100" and previous.is_enabled()
        following.click()
        wait.until(lambda d: _listed(d) == page[100:150])
        previous.click()
        wait.until(lambda d: _listed(d) == page[50:100])
        assert shown.text == "51–100"
        previous.click()
        wait.until(lambda d: _listed(d) == page[:50])
        assert not previous.is_enabled()

        # --- upload into it: the new id sorts after all 1,201 and is shown once uploaded
        note = tmp_path / "ferry.txt"
        note.write_text("The quindle harbour ferry leaves at noon.\n")
        driver.find_element(By.ID, "docs-file").send_keys(str(note))
        driver.find_element(By.ID, "docs-token").send_keys(TOKEN)
        driver.find_element(By.ID, "docs-upload").click()
        status = driver.find_element(By.ID, "docs-status")
        wait.until(lambda d: status.text.startswith("Uploaded"))
        fresh = driver.find_elements(By.CSS_SELECTOR, "#docs-list > li.is-new")
        assert len(fresh) == 1
        doc_id = fresh[0].get_attribute("data-doc-id")
        assert doc_id.startswith("sha256-") and doc_id > page[-1], doc_id
        assert doc_id in status.text and doc_id in _listed(driver)
        in_box = driver.execute_script(
            "const [li] = arguments; const r = li.getBoundingClientRect();"
            "const box = li.closest('.docs-scroll').getBoundingClientRect();"
            "return r.top >= box.top && r.bottom <= box.bottom",
            fresh[0],
        )
        assert in_box  # scrolled to inside the list's box
        _screenshot(driver, "ui-documents-paged.png")
        driver.set_window_size(1280, 900)

        # delete it: gone from the list; previous leads back to the first page
        driver.find_element(By.CSS_SELECTOR, f'#docs-list button[data-doc-id="{doc_id}"]').click()
        wait.until(lambda d: status.text == f"Deleted {doc_id}.")
        assert doc_id not in _listed(driver)
        if previous.is_enabled():
            previous.click()
        wait.until(lambda d: _listed(d) == page[:50])
        assert httpx.get(f"{gateway_url}/indexes/{MANY}/documents/{doc_id}").status_code == 404
    finally:
        httpx.post(f"{gateway_url}/admin/swap-index", json={"index": was_active}, headers=auth)
