"""Load test of a hosted dashboard: concurrent browser sessions against `ctxmix serve --hosted`.

    python bench/load.py                      # 4 sessions, then a flood; a few minutes on 2 cores
    python bench/load.py --sessions 12 --out load.csv

What it does, on the embedded MiniLM, with a fresh results cache:
1. starts `python -m ctxmix serve --hosted` on a free local port (a password set);
2. opens N headless Chromium sessions at once (Debian's chromium and chromedriver), each logs in
   and explains its own sentence on the Explain page; reports latency percentiles (login to the
   last plot) and the server's resident memory;
3. checks that what the concurrent sessions computed (the cached maps the server wrote) is
   bit-identical to the same explanations computed serially in this process;
4. floods the server: over-cap uploads (raw HTTP bodies above `server.maxUploadSize`) and corpus
   jobs from extra sessions while N fresh sessions explain again; reports whether those sessions
   were still answered, how many corpus sessions were told the server is busy, and the memory.
Prints one table (target, measured, goal, pass).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PASSWORD = "load-test-password"
SENTENCES = [
    "The keys to the cabinet are on the table .",
    "The cat that the dogs chase sleeps on the mat .",
    "She loves math rather than engaging in sports .",
    "A small dog barked at the old man .",
    "The authors that the guard likes are happy .",
    "The painting in the rooms is old .",
    "Every student who reads books learns a lot .",
    "The boy near the cars was running .",
    "My friends from the school are coming today .",
    "The report on the elections was long .",
    "The pilot that the teachers met flies planes .",
    "The coffee in the cups is still hot .",
]
METHODS = ["alti", "globenc", "value_zeroing"]


def log(msg: str) -> None:
    print(f"[load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the serve launcher starts Streamlit)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
            for t in os.listdir(f"/proc/{p}/task"):
                kids = open(f"/proc/{p}/task/{t}/children").read().split()
                todo += [int(k) for k in kids]
        except OSError:
            pass
    return total


def start_server(port: int, results: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CTXMIX_PASSWORD": PASSWORD, "CTXMIX_RESULTS": str(results)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxmix", "serve", "--hosted", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start:\n" + proc.stdout.read().decode()[-2000:])


def browser():
    """Headless Debian Chromium through selenium, with the flags a closed network needs
    (tests/test_browser.py uses it too)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,2400",
        "--disable-dev-shm-usage",
    ):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def _wait(drv, cond, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if cond():
                return True
        except Exception:  # noqa: BLE001 - the page is re-rendering
            pass
        time.sleep(0.5)
    return False


def login(drv, url: str) -> None:
    from selenium.webdriver.common.by import By

    drv.get(url)
    if not _wait(drv, lambda: drv.find_elements(By.CSS_SELECTOR, "input[type=password]"), 120):
        raise RuntimeError("no login form")
    drv.find_element(By.CSS_SELECTOR, "input[type=password]").send_keys(PASSWORD)
    for b in drv.find_elements(By.TAG_NAME, "button"):
        if b.text.strip() == "Enter":
            b.click()
            return
    raise RuntimeError("no Enter button")


def explain_session(port: int, text: str, timeout: float = 600) -> dict:
    """One user: log in, explain `text`, wait for the maps. Returns seconds and what it saw."""
    from urllib.parse import urlencode

    from selenium.webdriver.common.by import By

    drv = browser()
    try:
        q = urlencode([("text", text)] + [("method", m) for m in METHODS] + [("scopes", "0")])
        t0 = time.perf_counter()
        login(drv, f"http://127.0.0.1:{port}/?{q}")

        def done():
            running = drv.find_elements(By.CSS_SELECTOR, '[data-testid="stStatusWidget"]')
            plots = drv.find_elements(By.CSS_SELECTOR, '[data-testid="stPlotlyChart"] .main-svg')
            return len(plots) >= 3 and not running

        ok = _wait(drv, done, timeout)
        sec = time.perf_counter() - t0
        body = drv.find_element(By.TAG_NAME, "body").text
        return {
            "ok": ok and "Traceback" not in body,
            "seconds": sec,
            "exception": bool(drv.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')),
        }
    finally:
        drv.quit()


def corpus_session(port: int, timeout: float = 120) -> str:
    """A user who starts a corpus job (outliers over 100 wiki chunks): "busy", "running" or "error"."""
    from selenium.webdriver.common.by import By

    drv = browser()
    try:
        login(drv, f"http://127.0.0.1:{port}/LN_gamma_vs_FF_outliers?corpus=wiki&n=100")
        seen = {"v": "running"}

        def settled():
            body = drv.find_element(By.TAG_NAME, "body").text
            if "busy" in body:
                seen["v"] = "busy"
                return True
            if drv.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]') or "Traceback" in body:
                seen["v"] = "error"
                return True
            return False

        _wait(drv, settled, timeout)
        return seen["v"]
    finally:
        drv.quit()


def oversized_upload(port: int, mb: int) -> str:
    """A raw upload body above the server's cap, with no session: how the server answers."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/_stcore/upload_file/x/y",
        data=b"x" * (mb * 2**20),
        method="PUT",
        headers={"Content-Type": "application/octet-stream"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except OSError as e:  # the server closed the connection before reading the body
        return type(e).__name__


def concurrent(fn, args_list) -> list:
    out = [None] * len(args_list)

    def run(i, a):
        try:
            out[i] = fn(*a)
        except Exception as e:  # noqa: BLE001 - reported in the table
            out[i] = {"ok": False, "seconds": float("nan"), "error": f"{type(e).__name__}: {e}"}

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serial_check(results: Path, texts: list[str]) -> tuple[int, int, float]:
    """Compare the maps the server cached for `texts` with a serial computation here:
    (entries compared, entries equal bit for bit, largest difference)."""
    import numpy as np

    import ctxmix
    from ctxmix.service import cache

    m = ctxmix.load_model("minilm", device="cpu")
    fp = cache.model_fingerprint(m)
    n = same = 0
    worst = 0.0
    for t in texts:
        ex = ctxmix.explain(m, t, METHODS)
        for meth in METHODS:
            f = results / "explain" / f"{cache.key('explain', fp, t, meth, {})}.npz"
            if not f.exists():
                continue
            with np.load(f) as z:
                got = z["layer"]
            n += 1
            d = float(np.abs(got - ex.layer_maps[meth]).max())
            worst = max(worst, d)
            same += int(d == 0.0)
    return n, same, worst


def pct(values: list[float], q: float) -> float:
    import numpy as np

    v = [x for x in values if x == x]
    return float(np.percentile(v, q)) if v else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4, help="concurrent Explain sessions")
    ap.add_argument("--flood-jobs", type=int, default=4, help="extra sessions starting corpus jobs during the flood")
    ap.add_argument("--flood-uploads", type=int, default=4, help="over-cap raw uploads during the flood")
    ap.add_argument("--out", help="also write the table as CSV")
    a = ap.parse_args()
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        sys.exit("bench/load.py needs Debian's chromium and chromium-driver")
    import pandas as pd

    from ctxmix.service.limits import HOSTED

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results"
        port = free_port()
        log(f"starting ctxmix serve --hosted on port {port}")
        proc = start_server(port, results)
        try:
            base = rss_mb(proc.pid)
            log("warm-up session (loads the model once)")
            explain_session(port, "A warm-up sentence .")
            texts = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(a.sessions)]
            log(f"{a.sessions} concurrent Explain sessions")
            t0 = time.perf_counter()
            res = concurrent(explain_session, [(port, t) for t in texts])
            wall = time.perf_counter() - t0
            secs = [r["seconds"] for r in res]
            ok = sum(bool(r.get("ok")) for r in res)
            mem1 = rss_mb(proc.pid)
            rows += [
                {
                    "target": f"{a.sessions} concurrent sessions: answered without error",
                    "measured": f"{ok}/{a.sessions}",
                    "goal": "all",
                    "pass": ok == a.sessions,
                },
                {
                    "target": "  latency from login to the last plot: p50 / p90 / max",
                    "measured": f"{pct(secs, 50):.1f} / {pct(secs, 90):.1f} / {max(secs):.1f} s (wall {wall:.1f} s)",
                    "goal": "report",
                    "pass": "-",
                },
                {
                    "target": "  server memory (launcher + Streamlit)",
                    "measured": f"{base:.0f} MB idle, {mem1:.0f} MB after",
                    "goal": "report",
                    "pass": "-",
                },
            ]
            log("serial check of the cached maps")
            n, same, worst = serial_check(results, texts)
            rows.append(
                {
                    "target": "  concurrent maps vs the same explanations computed serially",
                    "measured": f"{same}/{n} bit-identical (max difference {worst:.1e})",
                    "goal": "all identical",
                    "pass": n > 0 and same == n,
                }
            )
            log(
                f"flood: {a.flood_uploads} uploads of {HOSTED.server_upload_mb + 5} MB, {a.flood_jobs} corpus jobs, "
                f"{a.sessions} Explain sessions"
            )
            texts2 = [t + " again" for t in texts]
            jobs: list = []
            ups: list = []
            th_jobs = threading.Thread(target=lambda: jobs.extend(concurrent(corpus_session, [(port,)] * a.flood_jobs)))
            th_ups = threading.Thread(
                target=lambda: ups.extend(
                    concurrent(oversized_upload, [(port, HOSTED.server_upload_mb + 5)] * a.flood_uploads)
                )
            )
            th_jobs.start()
            th_ups.start()
            res2 = concurrent(explain_session, [(port, t) for t in texts2])
            th_jobs.join()
            th_ups.join()
            mem2 = rss_mb(proc.pid)
            ok2 = sum(bool(r.get("ok")) for r in res2)
            secs2 = [r["seconds"] for r in res2]
            rows += [
                {
                    "target": "flood: Explain sessions still answered",
                    "measured": f"{ok2}/{a.sessions}, p50 {pct(secs2, 50):.1f} s, max {max(secs2):.1f} s",
                    "goal": "all",
                    "pass": ok2 == a.sessions,
                },
                {
                    "target": f"  corpus jobs started at once (cap {HOSTED.max_concurrent_jobs} per server)",
                    "measured": ", ".join(
                        f"{v}: {sum(1 for j in jobs if j == v)}" for v in ("running", "busy", "error")
                    ),
                    "goal": "no error",
                    "pass": all(j in ("running", "busy") for j in jobs),
                },
                {
                    "target": f"  over-cap uploads ({HOSTED.server_upload_mb + 5} MB, no session)",
                    "measured": ", ".join(sorted(set(map(str, ups)))),
                    "goal": "refused",
                    "pass": all(u != "200" for u in ups),
                },
                {
                    "target": "  server memory after the flood",
                    "measured": f"{mem2:.0f} MB ({mem2 - mem1:+.0f} MB)",
                    "goal": "bounded (< +1 GB)",
                    "pass": mem2 - mem1 < 1024,
                },
            ]
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    df = pd.DataFrame(rows, columns=["target", "measured", "goal", "pass"])
    df["pass"] = df["pass"].map(lambda v: v if v == "-" else ("yes" if v else "NO"))
    print(df.to_string(index=False))
    if a.out:
        df.to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
