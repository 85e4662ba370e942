"""The dashboard's browser: Debian's Chromium, headless, driven by Playwright (nothing is
downloaded). Used by the dashboard tests against a local API (tests/integration/api) and
against the API in cluster mode (tests/e2e). A missing Chromium fails: nothing skips."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("SPILLWAY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (Debian's package); "
                    "the dashboard tests need a real browser and never skip", pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def shot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def sign_in(page: Any, url: str, token: str) -> None:
    """Open the dashboard and give it the bearer token it asks for once."""
    page.goto(url + "/")
    dialog = page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    page.fill("#token-input", token)
    page.keyboard.press("Enter")
    dialog.wait_for(state="hidden")
