"""Runs one Serve config (a serve_config.yaml-shaped file) on a private Ray
cluster until SIGTERM: the harness's way to start Iris and Ray Serve LLM.

It deploys the config the way `serve run CONFIG` does, but on a Ray cluster of
its own with logical CPUs above the physical ones (Ray Serve LLM's ingress and
each of its replicas ask for a whole CPU) and a Prometheus endpoint that
refreshes every second, so the harness can read counters after each load point.

    python -m bench.harness.serve_runner CONFIG.yaml --num-cpus 8 --metrics-port PORT

Prints `READY` once every application is RUNNING, `FAILED <reason>` otherwise.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(open(args.config)))
    ray.init(num_cpus=args.num_cpus, namespace="serve", include_dashboard=False, log_to_driver=False,
             _metrics_export_port=args.metrics_port, _system_config={"metrics_report_interval_ms": 1000})
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
                print("FAILED " + ("; ".join(failed) or f"not running after {args.timeout_s:.0f} s: {states}")
                      .replace("\n", " "), flush=True)
                return
            time.sleep(1)
        print("READY", flush=True)
        while not stop["now"]:
            time.sleep(0.2)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
