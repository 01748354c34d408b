"""A headless Chromium that reads the dashboard's page: the browser tests and the container stack
check (docker/stack_check.py) drive Debian's chromium through Debian's chromedriver, which
`make install` installs (never a downloaded browser)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Iterator

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Without the background-networking flags Chromium keeps dialling hosts this machine cannot
# reach; --no-sandbox because the tests run as root.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1800"]


def missing() -> list[str]:
    """The browser's files that are not here (empty when it can run)."""
    return [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]


@contextlib.contextmanager
def browser(page_load_timeout_s: float = 60.0) -> Iterator[Any]:
    """A selenium WebDriver on a fresh profile, quit and cleaned up on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    if missing():
        raise RuntimeError(f"{', '.join(missing())} missing: `make install` installs Debian's chromium and "
                           "chromium-driver")
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.set_page_load_timeout(page_load_timeout_s)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
