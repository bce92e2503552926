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
PAGES = {
    "": 4,
    "Context_attribution": 0,
    "Contextualization_change": 3,
    "LN_gamma_vs_FF_outliers": 2,
    "Benchmarks": 0,
    "Saved_explanation": 0,
    "Images": 2,
    "Speech": 2,
}

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
    import ctxmix

    ctxmix.load_model("minilm-sentiment")  # built once into $CTXMIX_CACHE here, so the server only loads it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CTXMIX_RESULTS": str(tmp_path_factory.mktemp("results"))}
    # the server's output goes to a file: a pipe nobody reads fills up (64 KB) and blocks the server's
    # next log line, with the logging lock held, so every later page would hang
    log = open(tmp_path_factory.mktemp("server") / "streamlit.log", "w+b")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            "app.py",
            "--server.port",
            str(port),
            "--server.headless",
            "true",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        log.seek(0)
        pytest.fail("streamlit did not start:\n" + log.read().decode()[-3000:])
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # busy computing: no need to wait for it
        proc.kill()
        proc.wait(10)
    log.seek(0)
    print(log.read().decode(errors="replace")[-5000:])  # shown with a failing test
    log.close()


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
    out = Path(os.environ.get("CTXMIX_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(out / f"{page or 'explain'}.png"))
    body = browser.find_element(By.TAG_NAME, "body").text
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]'), body[-2000:]
    assert "Traceback" not in body
    assert plots >= want, f"{page}: {plots} plots rendered, expected at least {want}\n{body[-1500:]}"
    problems = browser.execute_script(LAYOUT_CHECK)
    assert not problems, problems[:10]


# Each scene: a URL of the Explain page, and what it must show. Screenshots go to $CTXMIX_SCREENSHOTS
# (CI keeps them) or the test's tmp folder; the JS check below finds overlapping tick labels, titles
# under the plotly toolbar and plots wider than their column.
SCENES = {
    "pair": (
        "model=minilm&method=alti&method=globenc&text=A+man+is+eating+a+sandwich+.&pair=Someone+eats+food+.",
        "Sentence pair",
        5,
    ),
    "head_grid": (
        "model=minilm&method=attention&method=norm&map=norm&heads=1&text=The+keys+to+the+cabinet+are+on+the+table+.",
        "every head",
        6,
    ),
    "contrastive": (
        "model=minilm-sentiment&method=grad_x_input&method=alti"
        "&target=positive&foil=negative&text=a+moving+and+wonderfully+acted+film+that+never+drags+.",
        "minus output 0",
        4,
    ),
    "prediction": (
        "model=minilm-sentiment&method=decompx&method=alti&text=a+moving+and+wonderfully+acted+film+.",
        "How the context builds the prediction",
        5,
    ),
    "routes": (None, "Information flow routes", 6),  # smollm2 with a generated continuation: `_routes_query`
}


def _routes_query() -> str:
    """The link of smollm2's page after Generate: the greedy continuation of a prompt, its last token chosen."""
    import urllib.parse

    import ctxmix
    from ctxmix.engine.generate import prompt_key

    m = ctxmix.load_model("smollm2")
    prompt = "The keys to the cabinet"
    g = ctxmix.generate(m, prompt, max_new_tokens=6)
    q = {
        "model": "smollm2",
        "method": "alti_logit",
        "text": prompt,
        "cont": ",".join(map(str, g.new_ids)),
        "gen_for": prompt_key(g.prompt_ids),
        "tok": str(g.generated_positions[-1]),
    }
    return urllib.parse.urlencode(q)


LAYOUT_CHECK = r"""
const problems = [];
const boxes = (root, sel) => Array.from(root.querySelectorAll(sel)).map(e => e.getBoundingClientRect())
  .filter(r => r.width > 0 && r.height > 0);
const hit = (a, b, pad) => a.left < b.right - pad && b.left < a.right - pad && a.top < b.bottom - pad && b.top < a.bottom - pad;
document.querySelectorAll('[data-testid="stPlotlyChart"]').forEach((chart, k) => {
  const box = chart.getBoundingClientRect();
  chart.querySelectorAll('svg.main-svg').forEach(svg => {
    const r = svg.getBoundingClientRect();
    if (r.width > box.width + 2) problems.push(`chart ${k}: ${r.width}px wide in a ${box.width}px column`);
  });
  for (const axis of ['xtick', 'ytick']) {
    chart.querySelectorAll(`g.${axis}`).forEach(() => {});
    const texts = Array.from(chart.querySelectorAll(`g.${axis} > text`));
    const byAxis = new Map();
    texts.forEach(t => { const key = t.closest('g.xaxislayer-above, g.yaxislayer-above') || t.parentNode.parentNode;
                         if (!byAxis.has(key)) byAxis.set(key, []); byAxis.get(key).push(t); });
    byAxis.forEach(ts => {
      const rot = /rotate\((-?\d+)/.exec(ts[0]?.getAttribute('transform') || '');
      const angle = rot ? Math.abs(+rot[1]) : 0;
      const rects = ts.map(t => t.getBoundingClientRect()).filter(r => r.width > 0);
      const size = parseFloat(getComputedStyle(ts[0] || document.body).fontSize) || 10;
      for (let i = 1; i < rects.length; i++) {
        const a = rects[i - 1], b = rects[i];
        if (angle === 0 || axis === 'ytick') {
          if (hit(a, b, 1)) problems.push(`chart ${k}: ${axis} labels ${i - 1} and ${i} overlap`);
        } else {
          const d = Math.abs((a.left + a.right) / 2 - (b.left + b.right) / 2) * Math.sin(angle * Math.PI / 180);
          if (d < 0.8 * size) problems.push(`chart ${k}: rotated ${axis} labels ${i - 1} and ${i} are ${d.toFixed(1)}px apart`);
        }
      }
    });
  }
  const bar = boxes(chart, '.modebar')[0];
  if (bar) boxes(chart, '.gtitle, .annotation-text').forEach((t, j) => {
    if (hit(t, bar, 1)) problems.push(`chart ${k}: title ${j} under the toolbar`);
  });
});
document.querySelectorAll('[data-testid="stMain"] *').forEach(el => {  // text cut off with an ellipsis
  if (!el.offsetParent || !el.textContent.trim() || el.closest('[data-testid="stPlotlyChart"], [data-testid="stDataFrame"]')) return;
  const st = getComputedStyle(el);
  if (st.textOverflow === 'ellipsis' && el.scrollWidth > el.clientWidth + 1)
    problems.push(`clipped text: ${el.textContent.slice(0, 60)}`);
});
return problems;
"""


@pytest.mark.parametrize("scene", list(SCENES))
def test_explain_scene_screenshot(server, browser, scene, tmp_path):
    """The Explain page with a sentence pair, the head grid, a contrastive target, DecompX's prediction
    section and a language model's generated token with its routes, in a real browser: it renders, shows
    its section, and no label overlaps or is clipped."""
    from selenium.webdriver.common.by import By

    query, must_show, want = SCENES[scene]
    browser.get(f"{server}/?{query or _routes_query()}")
    deadline = time.time() + 480
    plots, body = 0, ""
    while time.time() < deadline:
        time.sleep(2)
        running = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        plots = len(browser.find_elements(By.CSS_SELECTOR, '[data-testid="stPlotlyChart"] .main-svg'))
        body = browser.find_element(By.TAG_NAME, "body").text
        if plots >= want and not running and must_show in body:
            break
    time.sleep(2)  # plotly's last relayout
    out = Path(os.environ.get("CTXMIX_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script(
        "return document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || document.body.scrollHeight"
    )
    browser.set_window_size(1400, min(12000, max(2400, int(height) + 200)))
    time.sleep(2)
    browser.save_screenshot(str(out / f"explain_{scene}.png"))
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]'), body[-2000:]
    assert must_show in body, body[-1500:]
    assert plots >= want, f"{scene}: {plots} plots rendered, expected at least {want}"
    problems = browser.execute_script(LAYOUT_CHECK)
    browser.set_window_size(1400, 2400)
    assert not problems, problems[:10]


def test_context_attribution_scene(server, browser, tmp_path):
    """The Context attribution page on smollm2 with a needle context: the response, a word span picked from
    the link, the shaded context in its scroll box, the top-sources table, two methods side by side and the
    figure export open; screenshot, no overlapping or clipped labels."""
    import urllib.parse

    from selenium.webdriver.common.by import By

    q = urllib.parse.urlencode(
        {
            "model": "smollm2",
            "ctx": "The museum opened in 1902 in a former railway station. Its collection grew slowly at first. "
            "The code for the staff entrance is 4817. Visitors enter through the main hall on the north side.",
            "query": "What is the code for the staff entrance?",
            "resp": "The code for the staff entrance is 4817.",
            "cmethod": ["alti_logit", "logit"],
            "span_unit": "word",
            "pick": ["7"],  # "4817."
        },
        doseq=True,
    )
    browser.get(f"{server}/Context_attribution?{q}")
    deadline = time.time() + 480
    body = ""
    while time.time() < deadline:
        time.sleep(2)
        running = browser.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
        body = browser.find_element(By.TAG_NAME, "body").text
        if not running and "Two methods side by side" in body and "Explaining characters" in body:
            break
    # open the figure export (an expander) so its plotly table is checked too
    for ex in browser.find_elements(By.CSS_SELECTOR, '[data-testid="stExpander"] summary'):
        if "Export the shaded context" in ex.text:
            ex.click()
    time.sleep(4)
    out = Path(os.environ.get("CTXMIX_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script(
        "return document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || document.body.scrollHeight"
    )
    browser.set_window_size(1400, min(12000, max(2400, int(height) + 200)))
    time.sleep(2)
    browser.save_screenshot(str(out / "context_attribution.png"))
    assert not browser.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]'), body[-2000:]
    assert "The code for the staff entrance is 4817." in body and "Check by ablation" in body, body[-1500:]
    assert len(browser.find_elements(By.CSS_SELECTOR, "[data-source]")) >= 4  # the shaded sources
    problems = browser.execute_script(LAYOUT_CHECK)
    browser.set_window_size(1400, 2400)
    assert not problems, problems[:10]
