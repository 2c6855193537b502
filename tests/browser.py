"""A real browser for the page's tests: Debian's chromium, driven by selenium through Debian's
chromedriver, with nothing that could reach outside this machine.

- The driver is named outright (``Service(CHROMEDRIVER)``), so Selenium Manager never runs (it
  would look up and download drivers); ``SE_OFFLINE`` and a ``SE_MANAGER_PATH`` that does not
  exist make sure it could not even if asked.
- chromium starts headless with background networking, component updates, sync and the first-run
  tasks off, in a fresh profile (a temporary user-data-dir).
- Its performance log (the DevTools ``Network.*`` events) lists every request the page made, so a
  test can assert that none left the server's origin.

If the browser is missing, :func:`ensure_browser` installs it (``tools/install_browser.sh``:
apt-get, as ``make test`` does first) and skips the test, with the installer's reason, only when
that is impossible.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[1]
INSTALLER = REPO / "tools" / "install_browser.sh"
ARTIFACTS = Path(os.environ.get("HYBRIDLLM_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  # the rest of what could call home: pings, reports, phishing and extension updates
                  "--disable-default-apps", "--disable-extensions", "--no-default-browser-check", "--no-pings",
                  "--disable-domain-reliability", "--disable-client-side-phishing-detection",
                  "--safebrowsing-disable-auto-update", "--metrics-recording-only",
                  "--window-size=1440,960")


def ensure_browser() -> None:
    """Install chromium and chromium-driver when missing; skip (with why) when that is impossible."""
    pytest.importorskip("selenium", reason="selenium is in the dev extra (pip install -e '.[dev]')")
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    done = subprocess.run(["sh", str(INSTALLER)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        reason = (done.stderr.strip().splitlines() or ["the installer failed"])[-1]
        pytest.skip(f"no browser: chromium and chromium-driver could not be installed ({reason})")


@contextlib.contextmanager
def chromium(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A headless chromium (a selenium ``WebDriver``) in a fresh profile, quit at the end."""
    ensure_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")
    monkeypatch.setenv("SE_AVOID_STATS", "true")
    monkeypatch.setenv("SE_MANAGER_PATH", str(REPO / "no-selenium-manager"))  # never run: would fail
    with tempfile.TemporaryDirectory(prefix="hybridllm-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
        driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            driver.quit()


class NetworkLog:
    """Every URL requested (``Network.requestWillBeSent``) and every WebSocket opened since it was
    made, read from chromium's performance log as the test goes. Make it right before opening the
    page: it ends the browser's start-up tab (its chrome:// new-tab page, which loads on its own)
    with about:blank and drops what that tab loaded."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self.urls: list[str] = []
        self.websockets: list[str] = []
        driver.get("about:blank")
        driver.get_log("performance")

    def read(self) -> NetworkLog:
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                self.urls.append(message["params"]["request"]["url"])
            elif message["method"] == "Network.webSocketCreated":
                self.websockets.append(message["params"]["url"])
        return self

    def outside(self, origin: str) -> list[str]:
        """Requests to anything but ``origin`` (data: URLs are not requests; anything else is)."""
        return [url for url in self.urls + self.websockets
                if not (url == origin or url.startswith(origin + "/") or url.startswith("data:"))]


def script_errors(driver: Any) -> list[str]:
    """The page's JavaScript errors (the console's SEVERE entries that are not failed requests)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and entry.get("source") != "network"]


def save_screenshot(driver: Any, name: str) -> Path:
    """The page as it is now, saved under :data:`ARTIFACTS` (``HYBRIDLLM_TEST_ARTIFACTS``)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), path
    return path
