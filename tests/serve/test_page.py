"""The page at ``/`` in headless Chromium (Debian's chromium + chromium-driver, driven by Selenium):
it loads, streams a chat reply, and its live panel updates. Nothing downloads a browser."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
DOCS = Path(__file__).resolve().parents[2] / "docs"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)",
)


@pytest.fixture
def browser() -> Any:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="flashpage-chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,800",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_page_streams_a_reply_and_the_panel_updates(server: Any, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 90)
    browser.get(server.url + "/")
    wait.until(lambda d: "smollm2-135m-instruct" in d.find_element(By.ID, "model").text)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("24")
    browser.find_element(By.ID, "prompt").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()
    # The reply streams in: its text grows before the request ends (the meta line comes last).
    first = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text or False)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
    reply = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .text").text
    assert reply.startswith(first) and len(reply) >= len(first)
    assert "Paris" in reply or len(reply) > 10
    # The live panel: the decode phase with its kernel, the roofline drawn, tokens counted.
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#phases tr[data-phase='decode']"))
    row = browser.find_element(By.CSS_SELECTOR, "#phases tr[data-phase='decode']").text
    assert "paged_decode" in row
    assert browser.find_elements(By.CSS_SELECTOR, "#roofline circle")
    assert browser.find_element(By.ID, "kv-text").text != "–"
    wait.until(lambda d: d.find_element(By.ID, "tps").text not in ("–", "0.0"))
    assert browser.find_element(By.ID, "error").text == ""
    if os.environ.get("FLASHPAGE_SAVE_SCREENSHOT"):
        browser.save_screenshot(str(DOCS / "serve-page.png"))
