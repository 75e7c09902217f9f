"""One self-contained HTML page per gate: the SLA table, the run's figures, the latency
distributions, the KV watermark beside the arrivals, the capacity curve of a rate search, and
the exact command, workload and target. Every figure is a PNG inside the page (a data: URI) and
the style is inline, so the file opens anywhere with no network; it runs no script.

Made by `inflight bench --report FILE.html` and `inflight check --sla SLA RUN.json --report
FILE.html` (from a run file alone: it holds every request and sample the page shows).
"""

from __future__ import annotations

import base64
import html
import json
import shlex
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inflight.bench.report import TABLE_ROWS, format_cell
from inflight.bench.results import BenchRun
from inflight.bench.sla import SLA, CheckLine, check_run

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #1f2328; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #d0d7de; }
.verdict { display: inline-block; padding: 0.2em 0.8em; border-radius: 4px; font-weight: 600; color: white; }
.pass { background: #1a7f37; } .fail { background: #cf222e; } .none { background: #6e7781; }
table { border-collapse: collapse; margin: 0.6em 0; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #eaeef2; text-align: right; }
th:first-child, td:first-child { text-align: left; }
td.PASS { color: #1a7f37; font-weight: 600; } td.FAIL { color: #cf222e; font-weight: 600; }
td.SKIP { color: #6e7781; } tr.section td { font-weight: 600; background: #f6f8fa; text-align: left; }
img { max-width: 100%; border: 1px solid #eaeef2; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 12.5px; }
.meta { color: #57606a; }
"""


def render_report(document: dict[str, Any], runs: Sequence[BenchRun], sla: SLA | None = None,
                  sla_source: str | None = None) -> str:
    """The page for a run file's `document` and `runs`, checked against `sla` (else the SLA the
    run file recorded, if any)."""
    if sla is None and document.get("sla"):
        sla = SLA.model_validate(document["sla"])
        sla_source = sla_source or "recorded in the run file"
    workload = document.get("workload") or {}
    name = workload.get("name", "workload")
    checks = [(run, check_run(sla, run, workload.get("name"))) for run in runs] if sla else []
    capacity = document.get("capacity")
    if capacity is not None:
        verdict_ok: bool | None = bool(capacity.get("passed"))
    elif checks:
        verdict_ok = all(line.ok for _, lines in checks for line in lines)
    else:
        verdict_ok = None
    verdict = {True: ("pass", "PASS"), False: ("fail", "FAIL"), None: ("none", "no SLA")}[verdict_ok]
    title = f"inflight gate: {name}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        # No network: nothing but inline images and the inline style may load.
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        'style-src \'unsafe-inline\'">',
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f'<h1>{_e(title)} <span class="verdict {verdict[0]}" id="verdict">{verdict[1]}</span></h1>',
        f'<p class="meta">{_e(_describe_target(document))} &middot; {len(runs)} run(s) &middot; '
        f'{_e(document.get("created_at", ""))}</p>',
    ]
    parts += _sla_section(checks, sla_source)
    if capacity is not None:
        parts += _capacity_section(capacity, runs, name)
    parts += [_h2("Figures of each run"), _metrics_table(runs)]
    parts += [_h2("Latency distributions"), _figure(lambda p: _plots().plot_latency_cdfs(runs, p, name),
                                                    "CDFs of time to first token and time between tokens")]
    limit = sla.max_kv_peak_perc if sla else None
    parts += [_h2("KV watermark and arrivals"),
              _figure(lambda p: _plots().plot_kv_and_arrivals(runs, p, name, limit),
                      "KV cache used over time above the arrivals")]
    parts += _provenance(document)
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(path: Path, document: dict[str, Any], runs: Sequence[BenchRun], sla: SLA | None = None,
                 sla_source: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(document, runs, sla, sla_source), encoding="utf-8")
    return path


def _plots() -> Any:
    from inflight.bench import plots  # matplotlib: loaded only when a page is made

    return plots


def _e(value: Any) -> str:
    return html.escape(str(value))


def _h2(text: str, anchor: str = "") -> str:
    return f'<h2 id="{anchor}">{_e(text)}</h2>' if anchor else f"<h2>{_e(text)}</h2>"


def _describe_target(document: dict[str, Any]) -> str:
    target = document.get("target") or {}
    kind = target.get("kind", "?")
    if kind == "http":
        metrics = target.get("metrics") or {}
        server = metrics.get("server_kind") or "server"
        return f"{server} at {target.get('url', '?')} ({target.get('served_model_name', '?')})"
    if kind == "simulated":
        return f"simulated {target.get('model', '?')} on {(target.get('hardware') or {}).get('name', '?')}"
    return f"in-process engine ({target.get('model') or 'embedded model'})"


def _sla_section(checks: list[tuple[BenchRun, list[CheckLine]]], source: str | None) -> list[str]:
    if not checks:
        return [_h2("SLA", "sla-section"), '<p id="sla">No SLA was given: figures only.</p>']
    out = [_h2("SLA", "sla-section"), f'<p class="meta">{_e(source or "")}</p>',
           '<table id="sla"><thead><tr><th>line</th>'
           + "".join(f"<th>{_e(run.label)}</th>" for run, _ in checks) + "<th>limit</th></tr></thead><tbody>"]
    names = [line.name for line in checks[0][1]]
    for i, name in enumerate(names):
        cells = []
        for _, lines in checks:
            line = lines[i]
            shown = line.missing if line.measured is None else _value(line.measured, line.unit)
            cells.append(f'<td class="{line.status}">{line.status} {_e(shown)}</td>')
        limit = checks[0][1][i]
        out.append(f"<tr><td>{_e(name)}</td>{''.join(cells)}<td>{_e(_value(limit.limit, limit.unit))}</td></tr>")
    out.append("</tbody></table>")
    return out


def _value(value: Any, unit: str) -> str:
    if isinstance(value, float):
        value = f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return f"{value} {unit}".strip()


def _capacity_section(capacity: dict[str, Any], runs: Sequence[BenchRun], name: str) -> list[str]:
    by_label = {run.label: run for run in runs}
    trials = capacity.get("trials") or []
    best = capacity.get("max_rate")
    floor = capacity.get("min_request_rate")
    out = [_h2("Capacity under the SLA", "capacity"),
           f"<p>Highest passing rate: <b>{'none' if best is None else f'{best:.3g} req/s'}</b>"
           + (f"; the SLA's min_request_rate {floor:g} req/s {'passes' if capacity.get('passed') else 'fails'}"
              if floor is not None else "") + f". {_e(capacity.get('stopped', ''))}</p>",
           "<table><thead><tr><th>rate (req/s)</th><th>result</th><th>goodput (req/s)</th><th>attainment</th>"
           "<th>limiting lines</th></tr></thead><tbody>"]
    points = []
    for t in sorted(trials, key=lambda t: t["rate"]):
        run = by_label.get(t.get("label", ""))
        goodput = run.metrics.goodput if run else None
        points.append((t["rate"], goodput, t.get("attainment"), bool(t["passed"])))
        status = "PASS" if t["passed"] else "FAIL"
        attainment = "-" if t.get("attainment") is None else f"{100 * t['attainment']:.0f}%"
        limiting = ", ".join(t.get("limiting") or []) or "-"
        out.append(f'<tr><td>{t["rate"]:.4g}</td><td class="{status}">{status}</td>'
                   f'<td>{format_cell(goodput, ".2f")}</td><td>{attainment}</td><td>{_e(limiting)}</td></tr>')
    out.append("</tbody></table>")
    out.append(_figure(lambda p: _plots().plot_capacity(points, p, best, name),
                       "goodput and SLO attainment against the offered rate"))
    return out


def _metrics_table(runs: Sequence[BenchRun]) -> str:
    out = ["<table id=\"figures\"><thead><tr><th></th>"
           + "".join(f"<th>{_e(run.label)}</th>" for run in runs) + "</tr></thead><tbody>"]
    for row in TABLE_ROWS:
        if isinstance(row, str):
            out.append(f'<tr class="section"><td colspan="{len(runs) + 1}">{_e(row)}</td></tr>')
            continue
        label, get, spec = row
        out.append(f"<tr><td>{_e(label.strip())}</td>"
                   + "".join(f"<td>{_e(format_cell(get(run.metrics), spec))}</td>" for run in runs) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _figure(draw: Callable[[Path], Path], alt: str) -> str:
    """A plot drawn to a temporary PNG and inlined."""
    with tempfile.TemporaryDirectory() as folder:
        data = draw(Path(folder) / "figure.png").read_bytes()
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}"></p>'


def _provenance(document: dict[str, Any]) -> list[str]:
    command = document.get("command") or []
    workload = document.get("workload") or {}
    target = dict(document.get("target") or {})
    environment = document.get("environment") or {}
    out = [_h2("Command", "command"), f"<pre id=\"command-line\">{_e(shlex.join(command))}</pre>",
           _h2("Workload"),
           f'<p class="meta">{_e(workload.get("source", ""))}, seed {_e(workload.get("seed", "?"))}, '
           f'{_e(workload.get("num_requests", "?"))} requests, sha256 {_e(workload.get("sha256", "?"))}</p>',
           f"<pre>{_e(json.dumps(workload.get('spec'), indent=2))}</pre>",
           _h2("Target and machine"), f"<pre>{_e(json.dumps(target, indent=2, default=str))}</pre>",
           f"<pre>{_e(json.dumps(environment, indent=2, default=str))}</pre>"]
    if document.get("engine_options"):
        out.append(f"<pre>{_e(json.dumps(document['engine_options'], indent=2, default=str))}</pre>")
    return out
