"""Measurement: seeded workloads, a load generator (HTTP or in-process), metrics, plots and
the pre-launch SLA check (`inflight bench`, `inflight check`)."""
