"""Start `streamlit run app.py` on localhost and open every page in headless Chromium: each
renders its plots and shows no exception. `.ci/run` installs Debian's chromium and chromium-driver."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# URL path -> plots the page must show at least
PAGES = {"": 4, "Contextualization_change": 3, "LN_gamma_vs_FF_outliers": 2, "Benchmarks": 0, "Saved_explanation": 0}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("CI") or os.environ.get("CTXMIX_REQUIRE_BROWSER"):
            pytest.fail("chromium and chromedriver are required here (apt install chromium chromium-driver)")
        pytest.skip("no chromium/chromedriver on this machine")
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CTXMIX_RESULTS": str(tmp_path_factory.mktemp("results"))}
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                             "--server.headless", "true"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("streamlit did not start:\n" + proc.stdout.read().decode()[-3000:])
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    import importlib.util

    # one headless-Chromium recipe, shared with the load test (bench/load.py)
    spec = importlib.util.spec_from_file_location("ctxmix_bench_load", ROOT / "bench" / "load.py")
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    drv = load.browser()
    yield drv
    drv.quit()


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders(server, browser, page, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(f"{server}/{page}?corpus=pang_lee&n=4")
    want = PAGES[page]
    deadline = time.time() + 240
    plots = 0
    while time.time() < deadline:
        time.sleep(2)
        running = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        plots = len(browser.find_elements(By.CSS_SELECTOR, '[data-testid="stPlotlyChart"] .main-svg'))
        if plots >= want and not running and browser.find_elements(By.CSS_SELECTOR, "h1"):
            break
    browser.save_screenshot(str(tmp_path / f"{page or 'explain'}.png"))
    body = browser.find_element(By.TAG_NAME, "body").text
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]'), body[-2000:]
    assert "Traceback" not in body
    assert plots >= want, f"{page}: {plots} plots rendered, expected at least {want}\n{body[-1500:]}"
