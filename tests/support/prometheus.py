"""A real Prometheus (the Debian package's /usr/bin/prometheus) scraping the session's Ray cluster, for
the dashboard test: its own config, data folder and port, started as a child process and killed on exit."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.cache_fixtures import free_port

INSTALL_HINT = (
    "prometheus is not installed: `apt-get install -y prometheus` (Debian/Ubuntu; .ci/run and "
    "scripts/install.sh, run as root, install it), or put a prometheus binary on PATH"
)


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    assert binary, INSTALL_HINT
    return binary


def service_discovery_file() -> Path:
    """Where this session's Ray cluster lists its metrics endpoints for Prometheus (file_sd): its own
    session folder. /tmp/ray/prom_metrics_service_discovery.json links to the latest session's, which on a
    shared machine may be another Ray cluster's."""
    import ray

    return Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "prom_metrics_service_discovery.json"


@contextmanager
def prometheus(sd_file: Path, scrape_interval_s: float = 1.0, timeout_s: float = 30.0) -> Iterator[str]:
    """Prometheus scraping the targets in `sd_file` every `scrape_interval_s`; yields its base URL once
    it answers /-/ready."""
    binary = prometheus_binary()
    folder = Path(tempfile.mkdtemp(prefix="iris-prometheus-"))
    interval = f"{int(scrape_interval_s * 1000)}ms"
    (folder / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        f"scrape_configs:\n  - job_name: ray\n    file_sd_configs:\n      - files: ['{sd_file}']\n"
        f"        refresh_interval: 5s\n"
    )
    port = free_port()
    log = open(folder / "prometheus.log", "wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}"
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready after {timeout_s} s"
            time.sleep(0.1)
        yield url
    finally:
        process.kill()
        process.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
