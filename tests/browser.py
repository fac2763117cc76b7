"""Headless Chromium for the UI tests (``tests/test_ui.py``) and the screenshots they take.

Playwright for Python drives the system's Chromium (Debian's ``chromium`` package, installed
by ``make setup-test``): Playwright's own browser download is not reachable from every machine,
so it is never used. Each test gets a new browser context (no cookies, no local storage: a
first visit).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page, Playwright

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
VIEWPORT = {"width": 1280, "height": 800}
CANT_CONNECT = "Can't connect"
"""What the Prefect UI shows when it cannot reach its API (a toast and an empty page)."""
PAGE_TIMEOUT_MS = 120_000
"""Generous: the pages load from servers on a busy 2-core machine."""
SCREENSHOTS_ENV = "FLOWRL_SCREENSHOTS"


def chromium_path() -> str | None:
    """The system Chromium (``FLOWRL_CHROMIUM`` if set), or None when none is installed."""
    for candidate in (os.environ.get("FLOWRL_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


def why_no_browser() -> str | None:
    """None if a browser can be launched here; else a reason that names what to install."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed: pip install -e '.[dev]' (or make setup-test)"
    if chromium_path() is None:
        return (
            "no Chromium at /usr/bin/chromium: install it with `apt-get install chromium` "
            "(make setup-test does) or set FLOWRL_CHROMIUM to a Chromium binary"
        )
    return None


def require_browser() -> None:
    """Skip the calling test, printing what to install, where no browser can be installed; in
    CI (``CI`` set), where ``make setup-test`` installs one, a missing browser fails instead."""
    import pytest

    reason = why_no_browser()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the browser tests cannot run in CI: {reason}")
    print(f"\nskipping the browser tests: {reason}")
    pytest.skip(reason)


def launch(playwright: Playwright) -> Browser:
    """Headless Chromium from the system's package."""
    return playwright.chromium.launch(
        executable_path=chromium_path(), args=list(CHROMIUM_ARGS), headless=True
    )


def new_page(browser: Browser) -> Page:
    """A page in a fresh context (a first visit), 1280x800, UTC, with generous timeouts."""
    context = browser.new_context(viewport=VIEWPORT, timezone_id="UTC", locale="en-US")
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    context.set_default_navigation_timeout(PAGE_TIMEOUT_MS)
    return context.new_page()


def cant_connect(page: Page) -> Locator:
    return page.get_by_text(re.compile(CANT_CONNECT))


def wait_for(page: Page, content: Locator, timeout: float = PAGE_TIMEOUT_MS) -> None:
    """Wait until ``content`` is visible; fail at once, quoting it, if the page says it cannot
    connect to its API instead."""
    from playwright.sync_api import expect

    expect(content.or_(cant_connect(page)).first).to_be_visible(timeout=timeout)
    assert_connected(page)
    expect(content.first).to_be_visible(timeout=timeout)


def assert_connected(page: Page) -> None:
    """The page shows no "Can't connect" message."""
    shown = cant_connect(page)
    if shown.count():
        raise AssertionError(f"{page.url} says: {shown.first.inner_text()!r}")


def schema_field(page: Page, section: str, name: str) -> Locator:
    """The input of field ``name`` inside section ``section`` of a Prefect parameter form (as
    labelled there: ``"Schedule"``, ``"Steps"``; both carry an " (Optional)" suffix)."""
    field = f"normalize-space()='{name} (Optional)'"
    label = page.locator(
        f"xpath=//label[normalize-space()='{section} (Optional)']"
        f"/ancestor::div[.//label[{field}]][1]//label[{field}]"
    )
    return page.locator(f"[id='{label.get_attribute('for')}']")


def screenshot(
    page: Page, name: str, anchor: Locator | None = None, block: str = "start"
) -> Path | None:
    """With ``FLOWRL_SCREENSHOTS=<folder>``: the viewport as ``<folder>/<name>.png``, scrolled
    so that ``anchor`` (if given) is at its top (``block="center"``: its middle). Without it:
    nothing."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if not folder:
        return None
    if anchor is not None:
        anchor.first.evaluate(f"element => element.scrollIntoView({{block: '{block}'}})")
    path = Path(folder) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), animations="disabled", caret="hide")
    return path
