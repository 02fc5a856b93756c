"""The web page end to end in headless Chromium, over a live gateway and real backends.

Ask with RAG-Token and k=3, see the answer, the passages with prior/posterior bars and the
per-token heat map, swap the index with the admin token, see the label change. Screenshots go
to ``artifacts/`` (kept by CI). Needs Debian's ``chromium`` and ``chromium-driver`` and the
``selenium`` package (``scripts/install-browser.sh``); without them the test is skipped, or
fails where ``OPENBOOK_REQUIRE_BROWSER=1`` says the browser must be there.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from openbook_testkit.stack import running_backends, serving_gateway

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = os.environ.get("OPENBOOK_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("OPENBOOK_CHROMEDRIVER", "/usr/bin/chromedriver")
TOKEN = "ui-admin-token"
WAIT_S = 30


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
    redis_server.client().flushall()
    workdir = tmp_path_factory.mktemp("ui")
    with running_backends(workdir, redis_server.url, admin_token=TOKEN) as backends:
        settings = backends.gateway_settings(redis_server.url, admin_token=TOKEN)
        with serving_gateway(settings, timeout_s=WAIT_S) as url:
            yield url
    redis_server.client().flushall()  # leave no active index behind for other modules


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


def test_ask_see_answer_and_heatmap_then_swap_index(driver, gateway_url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(driver, WAIT_S)
    driver.get(gateway_url + "/")
    assert "openbook" in driver.title
    badge = driver.find_element(By.ID, "active-index")
    wait.until(lambda d: badge.text == "facts-a")

    # --- ask: question, RAG-Token, k = 3
    question = driver.find_element(By.ID, "question")
    question.send_keys("Who wrote Hamlet?")
    Select(driver.find_element(By.ID, "decoding")).select_by_value("rag-token")
    k = driver.find_element(By.ID, "k")
    k.clear()
    k.send_keys("3")
    driver.find_element(By.ID, "ask-button").click()

    wait.until(ec.visibility_of_element_located((By.ID, "result")))
    answer = driver.find_element(By.ID, "answer")
    assert answer.get_attribute("aria-live") == "polite"
    assert answer.text.strip()
    assert driver.find_element(By.ID, "form-error").get_attribute("hidden") is not None

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

    shot = _screenshot(driver, "ui-answer.png")
    assert shot.stat().st_size > 10_000

    # --- swap: a wrong token is refused and says so; the right one swaps
    driver.set_window_size(1280, 1000)
    driver.find_element(By.ID, "swap-open").click()
    dialog = driver.find_element(By.ID, "swap-dialog")
    wait.until(lambda d: dialog.get_attribute("open") is not None)
    options = [
        o.get_attribute("value")
        for o in driver.find_elements(By.CSS_SELECTOR, "#swap-index option")
    ]
    assert set(options) == {"facts-a", "facts-b"}
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

    # --- the next answer comes from the new index
    driver.find_element(By.ID, "ask-button").click()
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
    wait.until(lambda d: not d.find_element(By.ID, "heatmap").is_displayed())
    assert "RAG-Token" in driver.find_element(By.ID, "heatmap-note").text

    # --- narrow screen: still usable
    driver.set_window_size(390, 900)
    assert driver.find_element(By.ID, "ask-button").is_displayed()
    _screenshot(driver, "ui-mobile.png", width=390)
