"""The Iris Grafana dashboard (cluster/grafana/iris-dashboard.json) drawn from a real Prometheus: every
panel's queries through /api/v1/query_range, one plot per panel in a grid, saved as a PNG.

    python -m bench.dashboard_plot --prometheus http://127.0.0.1:9090 --minutes 5 --out docs/img/dashboard.png

Grafana's variables are filled in as Grafana would: $application (a regex of Serve application names),
$__rate_interval (here a fixed window). tests/test_dashboard.py draws docs/img/dashboard.png this way
from its own Prometheus when IRIS_DASHBOARD_PNG names a file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent.parent / "cluster/grafana/iris-dashboard.json"


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # the panel's title
    legend: str  # Grafana's legendFormat, e.g. "{{outcome}}"
    expr: str  # PromQL with Grafana's variables


def panel_queries(path: Path = DASHBOARD) -> list[PanelQuery]:
    dashboard = json.loads(path.read_text())
    return [
        PanelQuery(p["title"], t.get("legendFormat", ""), t["expr"])
        for p in dashboard["panels"]
        for t in p.get("targets", [])
    ]


def expand(expr: str, application: str = ".*", rate_interval: str = "1m") -> str:
    """`expr` as Grafana sends it to Prometheus for these values of the variables."""
    return expr.replace("$application", application).replace("$__rate_interval", rate_interval)


def _label(legend: str, metric: dict) -> str:
    """Grafana's legendFormat: {{label}} is the series' value of it, empty where it has none."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), legend).strip() or "value"


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    r = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step_s},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["data"]["result"]


def plot(
    prometheus: str, out: Path, start: float, end: float, application: str = ".*", rate_interval: str = "1m"
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queries = panel_queries()
    titles = list(dict.fromkeys(q.panel for q in queries))
    columns = 3
    rows = math.ceil(len(titles) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 4.2, rows * 2.5), squeeze=False)
    step = max(1.0, (end - start) / 200)
    for ax, title in zip(axes.flat, titles):
        for q in (q for q in queries if q.panel == title):
            for series in query_range(prometheus, expand(q.expr, application, rate_interval), start, end, step):
                ts = [float(t) - start for t, _ in series["values"]]
                ax.plot(
                    ts, [float(v) for _, v in series["values"]], label=_label(q.legend, series["metric"]), linewidth=1.2
                )
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(titles) :]:
        ax.axis("off")
    fig.suptitle(
        f"Iris dashboard, {len(titles)} panels (cluster/grafana/iris-dashboard.json), rate window {rate_interval}",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=5, help="the last N minutes")
    parser.add_argument("--application", default=".*", help="regex of Serve application names ($application)")
    parser.add_argument("--rate-interval", default="1m", help="the window of rate() ($__rate_interval)")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    end = time.time()
    plot(args.prometheus, args.out, end - args.minutes * 60, end, args.application, args.rate_interval)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
