"""What one item of a Ray Serve streaming call costs: a deployment that yields small byte
strings (an SSE chunk's size) as fast as it can, read through a deployment handle in this
process, as the fleet's ingress reads a replica. Prints items per second and the CPU
milliseconds per item at each end. This is the cost the fleet's relay (inflight/fleet/relay.py)
avoids paying per streamed chunk.

    .venv/bin/python benchmarks/ray_stream_cost.py              # ~30 s, Ray on 2 CPUs
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import AsyncIterator

import psutil


class Chunks:
    def pid(self) -> int:
        return os.getpid()

    async def stream(self, n: int, size: int) -> AsyncIterator[bytes]:
        chunk = b"data: " + b"x" * size + b"\n\n"
        for _ in range(n):
            yield chunk


async def _measure(handle: object, streams: int, n: int, size: int, replica: psutil.Process) -> None:
    import time

    async def one() -> int:
        return len([_ async for _ in handle.options(stream=True).stream.remote(n, size)])  # type: ignore[attr-defined]

    me = psutil.Process()
    here, there = me.cpu_times(), replica.cpu_times()
    started = time.monotonic()
    items = sum(await asyncio.gather(*[one() for _ in range(streams)]))
    wall = time.monotonic() - started
    here2, there2 = me.cpu_times(), replica.cpu_times()
    recv = (here2.user + here2.system - here.user - here.system) / items * 1e3
    send = (there2.user + there2.system - there.user - there.system) / items * 1e3
    print(f"{streams:>3} streams x {n:<5} {items / wall:8.0f} items/s   receiver {recv:.3f} ms/item   "
          f"sender {send:.3f} ms/item   both {recv + send:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=6000, help="items per run, split over the streams")
    parser.add_argument("--size", type=int, default=200, help="bytes per item")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             logging_level="WARNING")
    try:
        serve.start(proxy_location=ProxyLocation.Disabled, logging_config={"log_level": "WARNING"})
        app = serve.deployment(max_ongoing_requests=1000, logging_config={"log_level": "WARNING"})(Chunks).bind()
        handle = serve.run(app, name="ray-stream-cost", route_prefix=None)
        replica = psutil.Process(handle.pid.remote().result())
        print(f"{os.cpu_count()} CPUs; items of {args.size} bytes")
        for streams in (1, 16, 64):
            asyncio.run(_measure(handle, streams, args.items // streams, args.size, replica))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
