"""The gate's one-page report: self-contained (figures inline, nothing fetched), the SLA table,
figures, latency distributions, KV watermark beside the arrivals, the capacity curve, the command
and the workload; and opened in a real headless Chromium (Debian's, driven over the DevTools
protocol): it renders with no console error, every figure decodes, and a screenshot shows the SLA
table."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from inflight.bench.html_report import render_report
from inflight.bench.report import read_run_file
from inflight.cli import main

TINY = {"name": "tiny", "seed": 3, "num_requests": 4, "arrivals": {"kind": "poisson", "rate": 4},
        "prompt_len": {"kind": "uniform", "min": 8, "max": 24}, "output_len": {"kind": "uniform", "min": 2, "max": 4}}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def capacity_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A capacity search in-process (two trials) written as a run file and a report, with an SLA
    whose TBT line cannot pass, so the page holds PASS and FAIL alike."""
    folder = tmp_path_factory.mktemp("report")
    spec, sla = folder / "tiny.yaml", folder / "sla.yaml"
    spec.write_text(yaml.safe_dump(TINY))
    sla.write_text(yaml.safe_dump({"max_failed_requests": 0, "max_kv_peak_perc": 90, "max_tbt_p99_ms": 0.001,
                                   "min_request_rate": 1.0, "goodput": {"max_ttft_ms": 600_000}}))
    code = main(["bench", "--workload", str(spec), "--sla", str(sla), "--find-max-rate", "--max-trials", "2",
                 "--num-kv-blocks", "64", "--no-progress", "--output", str(folder / "run.json"),
                 "--report", str(folder / "report.html")])
    assert code == 1  # the TBT line fails at every rate
    return {"run": folder / "run.json", "report": folder / "report.html", "sla": sla}


def test_the_page_is_self_contained_and_holds_every_part(capacity_report: dict[str, Path]) -> None:
    page = capacity_report["report"].read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="verdict">FAIL<' in page
    # Nothing is fetched: no script, no external address in any src or href; figures are data URIs.
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:|//)""", page)
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == ["goodput and SLO attainment against the offered rate",
                                          "CDFs of time to first token and time between tokens",
                                          "KV cache used over time above the arrivals"]
    assert all(base64.b64decode(data).startswith(b"\x89PNG") for _, data in images)
    sla_table = page[page.index('<table id="sla">'):page.index("</table>", page.index('<table id="sla">'))]
    assert "TBT p99" in sla_table and 'class="FAIL"' in sla_table and 'class="PASS"' in sla_table
    document, runs = read_run_file(capacity_report["run"])
    for trial in document["capacity"]["trials"]:
        assert f"<td>{trial['rate']:.4g}</td>" in page
    assert "Capacity under the SLA" in page and "--find-max-rate" in page  # the command, as it was run
    assert f"sha256 {document['workload']['sha256']}" in page
    # The same page from the run file alone (what `inflight check --report` makes), the SLA read back.
    again = render_report(document, runs)
    assert re.sub(r"base64,[^\"]+", "", again) == re.sub(r"base64,[^\"]+", "", page).replace(
        f'<p class="meta">{capacity_report["sla"]}</p>', '<p class="meta">recorded in the run file</p>')


def test_check_writes_the_report_from_a_run_file(capacity_report: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "again.html"
    assert main(["check", "--sla", str(capacity_report["sla"]), str(capacity_report["run"]),
                 "--report", str(out)]) == 1
    assert '<table id="sla">' in out.read_text()


class DevTools:
    """A headless Chromium and one page of it, driven over the DevTools protocol."""

    def __init__(self, chromium: str, profile: Path) -> None:
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
             "--window-size=1200,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.stack = contextlib.ExitStack()
        self.socket = self.stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=None,
                                                       open_timeout=10))
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=30))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == event for e in self.events):
            self.events.append(json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic()))))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def errors(self) -> list[dict[str, Any]]:
        """What the page reported as an error: exceptions, console errors, the browser's own log
        (a resource refused or not found)."""
        return [e for e in self.events if e.get("method") == "Runtime.exceptionThrown"
                or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
                or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")]

    def load(self, path: Path) -> None:
        self.events.clear()
        self.call("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def close(self) -> None:
        if getattr(self, "stack", None) is not None:
            self.stack.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (scripts/setup.sh installs Debian's)")
def test_the_report_renders_in_chromium(capacity_report: dict[str, Path], tmp_path: Path) -> None:
    browser = DevTools(str(CHROMIUM), tmp_path / "profile")
    # A copy that asks for a picture over the network: the page's policy refuses it, and the
    # refusal is an error the check sees (so a clean page's empty list means something).
    leaky = tmp_path / "leaky.html"
    leaky.write_text(capacity_report["report"].read_text().replace(
        "</body>", '<img alt="remote" src="https://example.invalid/x.png"></body>'))
    try:
        for domain in ("Page", "Runtime", "Log"):
            browser.call(f"{domain}.enable")
        browser.load(leaky)
        browser.call("Runtime.evaluate", expression="0")  # collects any event still in flight
        refused = browser.errors()
        browser.load(capacity_report["report"])
        images = browser.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt])")
        rows = browser.evaluate("Array.from(document.querySelectorAll('#sla tbody tr'))"
                                ".map(r => Array.from(r.cells).map(c => c.innerText))")
        box = browser.evaluate("(() => { const r = document.getElementById('sla').getBoundingClientRect();"
                               " return [r.x, r.y, r.width, r.height, window.innerHeight]; })()")
        shot = browser.call("Page.captureScreenshot", format="png",
                            clip={"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1})
        browser.call("Runtime.evaluate", expression="0")
        errors = browser.errors()
    finally:
        browser.close()
    assert refused and "example.invalid" in json.dumps(refused)
    assert errors == []
    assert len(images) == 3 and all(complete and width >= 600 for complete, width, _ in images)
    assert "TBT p99" in [row[0] for row in rows] and "KV cache peak" in [row[0] for row in rows]
    assert any(cell.startswith("FAIL") for row in rows for cell in row)
    x, y, width, height, viewport = box
    assert 0 <= y and y + height <= viewport and width > 200 and height > 60  # in the first screen
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(base64.b64decode(shot["data"])), format="png")
    (tmp_path / "sla-table.png").write_bytes(base64.b64decode(shot["data"]))
    assert pixels.shape[0] == pytest.approx(height, abs=2) and pixels.shape[1] == pytest.approx(width, abs=2)
    ink = (pixels[..., :3].mean(axis=2) < 0.5).mean()  # dark pixels: the table's text
    red = ((pixels[..., 0] > 0.6) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)).any()  # a FAIL cell
    assert 0.01 < ink < 0.5 and bool(red) and np.isfinite(pixels).all()
