"""Ray Serve's autoscaling under load, on a real fleet: `inflight serve --replicas 1
--min-replicas 1 --max-replicas N`, long requests arriving over `--spread` seconds (0: one
burst), then quiet; printed once a second, the requests running on each replica and those done,
until the fleet is back to its minimum.

    .venv/bin/python benchmarks/fleet_autoscale.py --spread 0            # one burst: 1 -> 2 -> 1, ~1 min
    .venv/bin/python benchmarks/fleet_autoscale.py --spread 40 --requests 48   # sustained load
    .venv/bin/python benchmarks/fleet_autoscale.py --max-replicas 4 --replica-cpus 2 --requests 64
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import httpx
from serving import replicas_reporting, start_serve, stop

from inflight.bench.server_metrics import parse_prometheus

REPORTING = "inflight:fleet_replicas_reporting"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=int, default=1)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--spread", type=float, default=0.0, help="seconds over which the requests start")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--target-ongoing-requests", type=float, default=4)
    parser.add_argument("--downscale-delay", type=float, default=15)
    parser.add_argument("--port", type=int, default=None, help="default: a free one")
    args = parser.parse_args()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "fleet-autoscale.log"
    proc, url = start_serve(["--replicas", "1", "--min-replicas", "1", "--max-replicas", str(args.max_replicas),
                             "--replica-cpus", str(args.replica_cpus),
                             "--target-ongoing-requests", str(args.target_ongoing_requests), "--upscale-delay", "2",
                             "--downscale-delay", str(args.downscale_delay), "--num-kv-blocks", "512",
                             "--log-level", "warning"], log, ready=replicas_reporting(1), port=args.port)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        done = [0]

        def one(i: int) -> None:
            time.sleep(args.spread * i / args.requests)
            body = {"model": model, "prompt": f"Chapter {i}.", "max_tokens": args.max_tokens, "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=body, timeout=600)
            done[0] += 1

        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.requests)]
        for t in threads:
            t.start()
        print(f"{'t (s)':>6} {'replicas':>8} {'waiting':>8} {'done':>5}  running on each replica")
        peak, back_at = 1, None
        while time.monotonic() - t0 < 600:
            text = httpx.get(url + "/metrics", timeout=5).text
            values = parse_prometheus(text)
            replicas = int(values.get(REPORTING, 0))
            peak = max(peak, replicas)
            waiting = int(values.get("inflight:num_requests_waiting", 0))
            each = [line.rsplit(" ", 1)[1].split(".")[0] for line in text.splitlines()
                    if line.startswith("inflight:num_requests_running{")]
            print(f"{time.monotonic() - t0:6.0f} {replicas:8d} {waiting:8d} {done[0]:5d}  {' '.join(each)}", flush=True)
            if done[0] == args.requests and peak > 1 and replicas == 1:
                back_at = time.monotonic() - t0
                break
            time.sleep(1)
        print(f"peak {peak} replicas; back to 1 at {back_at if back_at is None else round(back_at)} s")
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
