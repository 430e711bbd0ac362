"""Runs one Serve config (a serve_config.yaml-shaped file) on a private Ray
cluster until SIGTERM: the harness's way to start Iris and Ray Serve LLM.

It deploys the config the way `serve run CONFIG` does, but on a Ray cluster of
its own with logical CPUs above the physical ones (Ray Serve LLM's ingress and
each of its replicas ask for a whole CPU) and a Prometheus endpoint that
refreshes every second, so the harness can read counters after each load point.

    python -m bench.harness.serve_runner CONFIG.yaml --num-cpus 8 --metrics-port PORT [--status-log FILE]

Prints `READY` once every application is RUNNING, `FAILED <reason>` otherwise.
With --status-log it then appends one JSON line per --status-interval-s: the
wall-clock time and each deployment's replica counts by state, from
`serve.status()` (bench/autoscale.py watches the autoscaler with it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import yaml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--num-cpus", type=int, default=8)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--status-log", help="append replica counts per deployment as JSON lines here")
    parser.add_argument("--status-interval-s", type=float, default=1.0)
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(open(args.config)))
    # address="local": a Ray instance of its own, even where RAY_ADDRESS names another (a test
    # session's cluster): each system under test runs alone.
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        namespace="serve",
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=args.metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        serve.start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location)
        _get_global_client().deploy_apps(config, _blocking=False)
        names = [app.name for app in config.applications]
        deadline = time.monotonic() + args.timeout_s
        while not stop["now"]:
            statuses = serve.status().applications
            states = {name: statuses[name].status if name in statuses else "NOT_STARTED" for name in names}
            if all(state == "RUNNING" for state in states.values()):
                break
            failed = [f"{n}: {statuses[n].message}" for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")]
            if failed or time.monotonic() > deadline:
                print(
                    "FAILED "
                    + ("; ".join(failed) or f"not running after {args.timeout_s:.0f} s: {states}").replace("\n", " "),
                    flush=True,
                )
                return
            time.sleep(1)
        print("READY", flush=True)
        next_status = 0.0
        while not stop["now"]:
            if args.status_log and time.monotonic() >= next_status:
                next_status = time.monotonic() + args.status_interval_s
                _append_status(args.status_log, serve.status())
            time.sleep(0.1)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _append_status(path: str, status) -> None:
    """One line: {"t": wall-clock seconds, "replicas": {deployment: {state: count}}}."""
    replicas = {
        name: {str(getattr(state, "value", state)): count for state, count in overview.replica_states.items()}
        for app in status.applications.values()
        for name, overview in app.deployments.items()
    }
    with open(path, "a") as out:
        out.write(json.dumps({"t": time.time(), "replicas": replicas}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
