"""PNG plots of bench runs (matplotlib, Agg): latency CDFs, KV use over time (alone, and beside
the arrivals), the step timeline of in-process runs side by side, the trade-off curve of a
sweep and the capacity curve of a rate search."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from inflight.bench.results import BenchRun  # noqa: E402
from inflight.bench.timeline import Timeline  # noqa: E402

# Cell states of the occupancy raster.
EMPTY, WAITING, PREFILL, DECODE, HELD = range(5)
_STATE_COLORS = ["white", "#e3e3e3", "#f28e2b", "#4e79a7", "#e15759"]
_STATE_NAMES = ["", "arrived, waiting", "prefill", "decode", "slot held idle (static)"]
_MAX_TIMELINE_COLUMNS = 4
# The step timeline's speculative tokens: proposals the model kept, and those it rejected.
_SPEC_COLORS = ["#59a14f", "#b6d7a8"]


def plot_runs(runs: Sequence[BenchRun], folder: Path, title: str = "",
              sweep_keys: Sequence[str] = ()) -> list[Path]:
    """Writes every plot that the runs support; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [plot_latency_cdfs(runs, folder / "latency_cdf.png", title),
               plot_kv_usage(runs, folder / "kv_usage.png", title)]
    with_timeline = [r for r in runs if r.capture.timeline is not None and r.capture.timeline.steps]
    for start in range(0, len(with_timeline), _MAX_TIMELINE_COLUMNS):
        group = with_timeline[start:start + _MAX_TIMELINE_COLUMNS]
        suffix = "" if len(with_timeline) <= _MAX_TIMELINE_COLUMNS else f"_{start // _MAX_TIMELINE_COLUMNS + 1}"
        written.append(plot_timelines(group, folder / f"timeline{suffix}.png", title))
    if sweep_keys and len(runs) > 1:
        written.append(plot_tradeoff(runs, sweep_keys[0], folder / "tradeoff.png", title))
    return written


def _ecdf(values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    x = np.sort(np.asarray(values, dtype=float))
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def plot_latency_cdfs(runs: Sequence[BenchRun], path: Path, title: str = "") -> Path:
    fig, (ax_ttft, ax_tbt) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        done = [r for r in run.capture.results if r.ok]
        ttft = [r.ttft_s * 1000 for r in done if r.ttft_s is not None]
        tbt = [g * 1000 for r in done for g in r.token_gaps_s]
        if ttft:
            ax_ttft.step(*_ecdf(ttft), where="post", label=run.label)
        if tbt:
            ax_tbt.step(*_ecdf(tbt), where="post", label=run.label)
    for ax, name in ((ax_ttft, "time to first token (ms)"), (ax_tbt, "time between tokens (ms)")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(_minor_label))
        ax.set_xlabel(name + ", log scale")
        ax.set_ylabel("fraction of " + ("requests" if ax is ax_ttft else "token gaps"))
        ax.axhline(0.99, color="gray", lw=0.8, ls=":")
        ax.text(0.01, 0.985, "p99", transform=ax.transAxes, va="top", fontsize=8, color="gray")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
    ax_ttft.set_title("TTFT CDF")
    ax_tbt.set_title("TBT CDF")
    fig.suptitle(f"{title}: latency distributions" if title else "latency distributions")
    return _save(fig, path)


def _minor_label(value: float, _: int) -> str:
    """Labels 2x and 5x between decades, so a log axis reads in plain milliseconds."""
    mantissa = value / 10 ** np.floor(np.log10(value))
    return f"{value:g}" if round(mantissa) in (2, 5) else ""


def plot_kv_usage(runs: Sequence[BenchRun], path: Path, title: str = "") -> Path:
    fig, (ax_kv, ax_q) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        samples = run.capture.samples
        if not samples:
            continue
        color = colors[i % len(colors)]
        t = [s.t_s for s in samples]
        ax_kv.step(t, [s.kv_usage_perc for s in samples], where="post", color=color, label=f"{run.label} allocated")
        # The live tokens' share of the pool: allocated times the share of it that is live.
        live = [s.kv_usage_perc * (s.kv_live_perc if s.kv_live_perc is not None else 100.0) / 100 for s in samples]
        ax_kv.step(t, live, where="post", color=color, ls=":", label=f"{run.label} live tokens")
        ax_q.step(t, [s.num_running for s in samples], where="post", color=color, label=f"{run.label} running")
        ax_q.step(t, [s.num_waiting for s in samples], where="post", color=color, ls="--", alpha=0.8,
                  label=f"{run.label} waiting")
    ax_kv.set_ylabel("KV cache used (%)")
    ax_kv.set_ylim(0, 100)
    ax_kv.set_title("KV cache usage: blocks allocated (solid) and slots holding live tokens (dotted)")
    ax_q.set_ylabel("requests")
    ax_q.set_xlabel("time since start (s)")
    ax_q.set_title("running (solid) and waiting (dashed) requests")
    for ax in (ax_kv, ax_q):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right", ncol=2 if ax is ax_q else 1)
    fig.suptitle(f"{title}: engine state over time" if title else "engine state over time")
    return _save(fig, path)


def plot_kv_and_arrivals(runs: Sequence[BenchRun], path: Path, title: str = "",
                         kv_limit_perc: float | None = None) -> Path:
    """The KV watermark over time (blocks allocated, %) above the load that drove it: requests
    arriving per interval (bars) and running in the engine (line), on one time axis; the SLA's
    KV peak limit drawn across, if given."""
    fig, (ax_kv, ax_load) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[3, 2])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ends = [max([s.t_s for s in run.capture.samples] + [r.arrival_s for r in run.capture.results] + [1e-3])
            for run in runs]
    bins = np.linspace(0, max(ends + [1e-3]), 41)
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        samples = run.capture.samples
        if samples:
            ax_kv.step([s.t_s for s in samples], [s.kv_usage_perc for s in samples], where="post", color=color,
                       label=run.label)
            ax_load.step([s.t_s for s in samples], [s.num_running for s in samples], where="post", color=color,
                         label=f"{run.label} running")
        counts, _ = np.histogram([r.arrival_s for r in run.capture.results], bins=bins)
        width = (bins[1] - bins[0]) / max(len(runs), 1)
        ax_load.bar(bins[:-1] + i * width, counts, width=width, align="edge", color=color, alpha=0.3,
                    label=f"{run.label} arrivals per {bins[1] - bins[0]:.2g} s")
    if kv_limit_perc is not None:
        ax_kv.axhline(kv_limit_perc, color="tab:red", ls="--", lw=1, label=f"SLA KV peak limit {kv_limit_perc:g}%")
    if not any(run.capture.samples for run in runs):
        ax_kv.text(0.5, 0.5, "the target exposed no KV usage", transform=ax_kv.transAxes, ha="center")
    ax_kv.set_ylabel("KV cache used (%)")
    ax_kv.set_ylim(0, 100)
    ax_kv.set_title("KV watermark: blocks allocated over time")
    ax_load.set_ylabel("requests")
    ax_load.set_xlabel("time since start (s)")
    ax_load.set_title("arrivals (bars) and requests running (line)")
    for ax in (ax_kv, ax_load):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{title}: KV watermark and load" if title else "KV watermark and load")
    return _save(fig, path)


def occupancy(timeline: Timeline, arrivals_s: Sequence[float], static: bool) -> np.ndarray:
    """Raster of cell states, one row per request (in order of first admission), one column per
    step: waiting from arrival to first admission, prefill up to the step that produced its
    first token, decode after; for static batching, the slot held idle until its batch ends."""
    steps = timeline.steps
    num_steps, num_requests = len(steps), len(arrivals_s)
    grid = np.full((num_requests, num_steps), EMPTY, dtype=np.int8)
    first_seen: dict[int, int] = {}
    for s, step in enumerate(steps):
        for idx in step.request_indices:
            first_seen.setdefault(idx, s)
            grid[idx, s] = PREFILL if s <= timeline.first_token_step.get(idx, num_steps) else DECODE
    starts = np.array([st.t_s for st in steps])
    for idx, arrival in enumerate(arrivals_s):
        arrived = int(np.searchsorted(starts, arrival, side="left"))
        end = first_seen.get(idx, num_steps)
        grid[idx, arrived:end] = np.where(grid[idx, arrived:end] == EMPTY, WAITING, grid[idx, arrived:end])
    if static:
        batches: dict[int, list[int]] = {}
        for idx, s in first_seen.items():
            batches.setdefault(s, []).append(idx)
        for members in batches.values():
            batch_end = max(timeline.last_token_step.get(i, 0) for i in members)
            for i in members:
                last = timeline.last_token_step.get(i, batch_end)
                grid[i, last + 1:batch_end + 1] = HELD
    order = sorted(range(num_requests), key=lambda i: (first_seen.get(i, num_steps), i))
    return grid[order]


def plot_timelines(runs: Sequence[BenchRun], path: Path, title: str = "") -> Path:
    fig, axes = plt.subplots(2, len(runs), figsize=(6.5 * len(runs), 8.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.4]})
    cmap = ListedColormap(_STATE_COLORS)
    # One token scale for all columns; a static batch's admission step (every prompt plus its
    # padding at once) would flatten the others, so steps above the 99th percentile are clipped.
    totals = [np.array([s.num_prefill_tokens + s.num_decode_tokens + s.num_spec_tokens + s.num_wasted_tokens
                        for s in r.capture.timeline.steps]) for r in runs if r.capture.timeline]
    y_max = 1.15 * max(float(np.percentile(t, 99)) for t in totals if len(t)) or 1.0
    for col, run in enumerate(runs):
        timeline = run.capture.timeline
        assert timeline is not None
        static = str(run.options.get("scheduling_policy", "")).endswith("static")
        grid = occupancy(timeline, [r.arrival_s for r in run.capture.results], static)
        ax = axes[0][col]
        ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=len(_STATE_COLORS) - 1)
        ax.set_title(f"{run.label}: {len(timeline.steps)} steps")
        ax.set_ylabel("request (by admission)")
        steps = timeline.steps
        x = np.arange(len(steps))
        prefill = np.array([s.num_prefill_tokens for s in steps])
        decode = np.array([s.num_decode_tokens for s in steps])
        wasted = np.array([s.num_wasted_tokens for s in steps])
        kept = np.array([s.num_accepted_tokens for s in steps])
        rejected = np.array([s.num_spec_tokens for s in steps]) - kept
        layers = [(decode, _STATE_COLORS[DECODE], "decode"), (prefill, _STATE_COLORS[PREFILL], "prefill"),
                  (kept, _SPEC_COLORS[0], "proposed, kept"), (rejected, _SPEC_COLORS[1], "proposed, rejected"),
                  (wasted, _STATE_COLORS[HELD], "wasted (idle slots, padding)")]
        ax2 = axes[1][col]
        base = np.zeros(len(steps), dtype=np.int64)
        for values, color, name in layers:
            if name.startswith("proposed") and not values.any():
                continue  # no speculative decoding in this run
            ax2.fill_between(x, base, base + values, step="post", color=color, label=name, lw=0)
            base = base + values
        ax2.set_xlim(ax.get_xlim())
        ax2.set_ylim(0, y_max)
        clipped = base > y_max
        if clipped.any():
            ax2.text(0.99, 0.97, f"{clipped.sum()} step(s) clipped, up to {base.max()} tokens",
                     transform=ax2.transAxes, ha="right", va="top", fontsize=8)
        ax2.set_xlabel("engine step")
        ax2.set_ylabel("tokens in step")
        ax2.grid(True, alpha=0.3)
        spec = f", proposed {kept.sum() + rejected.sum()} (kept {kept.sum()})" if rejected.any() or kept.any() else ""
        ax2.set_title(f"decode {decode.sum()}, prefill {prefill.sum()}{spec}, wasted {wasted.sum()} "
                      f"({100 * wasted.sum() / max(base.sum(), 1):.0f}%)", fontsize=9)
        if col == 0 or spec:  # the first column's, and each with proposals (their colors)
            ax2.legend(fontsize=8, loc="upper left")
    handles = [Patch(color=c, label=n) for c, n in zip(_STATE_COLORS[1:], _STATE_NAMES[1:], strict=True)]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=9, bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(f"{title}: which requests each step computed" if title else "step timeline", y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, path, tight=False)


def plot_tradeoff(runs: Sequence[BenchRun], key: str, path: Path, title: str = "") -> Path:
    """Throughput, TTFT p99 and TBT p99 against the swept option; one line per other setting."""
    groups: dict[str, list[BenchRun]] = {}
    for run in runs:
        rest = " ".join(p for p in run.label.split() if not p.startswith(f"{key}="))
        groups.setdefault(rest or "", []).append(run)
    panels = [("output throughput (tok/s)", lambda m: m.output_throughput),
              ("TTFT p99 (ms)", lambda m: m.ttft_ms.p99),
              ("TBT p99 (ms)", lambda m: m.tbt_ms.p99)]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for name, members in groups.items():
        xs = [r.options.get(key) for r in members]
        for ax, (_, get) in zip(axes, panels, strict=True):
            ys = [get(r.metrics) for r in members]
            ax.plot([str(x) for x in xs], [np.nan if y is None else y for y in ys], marker="o", label=name or None)
    for ax, (ylabel, _) in zip(axes, panels, strict=True):
        ax.set_xlabel(key)
        ax.set_ylabel(ylabel)
        ax.set_title(ylabel)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        ax.grid(True, alpha=0.3)
        if any(groups):
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: trade-off as {key} changes" if title else f"trade-off as {key} changes")
    return _save(fig, path)


def plot_capacity(points: Sequence[tuple[float, float | None, float | None, bool]], path: Path,
                  max_rate: float | None, title: str = "") -> Path:
    """Goodput (req/s) and SLO attainment (%) against the offered rate, one point per trial of a
    capacity search (rate, goodput, attainment, passed): passing trials filled, failing hollow,
    the highest passing rate marked."""
    points = sorted(points)
    rates = [p[0] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, index, label in ((axes[0], 1, "goodput (req/s)"), (axes[1], 2, "SLO attainment (%)")):
        values = [np.nan if (v := p[index]) is None else float(v) * (100 if index == 2 else 1) for p in points]
        ax.plot(rates, values, color="tab:blue", alpha=0.5)
        for rate, value, (_, _, _, passed) in zip(rates, values, points, strict=True):
            ax.plot([rate], [value], marker="o", color="tab:blue", fillstyle="full" if passed else "none",
                    markersize=8, linestyle="")
        if index == 1:
            ax.plot(rates, rates, color="gray", linestyle=":", label="offered rate")
            ax.legend(fontsize=8)
        if max_rate is not None:
            ax.axvline(max_rate, color="tab:green", linestyle="--", alpha=0.7)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    best = "none passed" if max_rate is None else f"highest passing {max_rate:.3g} req/s"
    fig.suptitle(f"{title}: capacity under the SLA ({best})" if title else f"capacity under the SLA ({best})")
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path, tight: bool = True) -> Path:
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
