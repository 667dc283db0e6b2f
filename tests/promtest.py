"""A real Prometheus for tests: /usr/bin/prometheus on a free loopback port, a tmp data dir, a
generated scrape config for the given targets, scrape and rule evaluation every second.

    with Prometheus({"betelgeuse-worker": ["127.0.0.1:9464"]}, tmp_path, rule_files=[RULES]) as prom:
        prom.wait_for_targets_up()
        prom.wait_for_samples("betelgeuse_prompt_tokens_total", n=3)
        result = prom.query('sum(rate(betelgeuse_prompt_tokens_total[1m]))')   # data.result list

Started with Popen and stopped by its PID (SIGTERM, then SIGKILL). Skip a test when it is missing
with `pytest.mark.skipif(not promtest.available(), ...)`; deploy/bootstrap.sh installs the Debian
`prometheus` package, which provides it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

PROMETHEUS = os.environ.get("BETELGEUSE_PROMETHEUS", "/usr/bin/prometheus")


def available() -> bool:
    return os.access(PROMETHEUS, os.X_OK)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_config(targets: dict[str, list[str]], rule_files=(), interval: str = "1s") -> str:
    """YAML (JSON is YAML) for the given job -> [host:port] targets."""
    cfg = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(t)}]} for job, t in targets.items()],
    }
    return json.dumps(cfg, indent=2)


class Prometheus:
    def __init__(self, targets: dict[str, list[str]], workdir: str | Path, rule_files=(),
                 scrape_interval: str = "1s", port: int | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.workdir / "prometheus.yml"
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(scrape_config(targets, rule_files, scrape_interval))
        self.log = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "Prometheus":
        assert self.proc is None, "already started"
        if not available():
            raise FileNotFoundError(f"{PROMETHEUS} not found (apt-get install prometheus)")
        data = self.workdir / "data"
        shutil.rmtree(data, ignore_errors=True)
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={data}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"prometheus not ready after {timeout}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP API ----------------------------------------------------------------------------

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error body
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict:
        """Instant query: {"resultType": "vector"|"matrix"|"scalar"|"string", "result": ...}."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for_targets_up(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ts = self.targets()
            if ts and all(t["health"] == "up" for t in ts):
                return
            time.sleep(0.2)
        raise TimeoutError(f"targets not up: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in self.targets()]}")

    def wait_for_samples(self, metric: str, n: int = 3, window: str = "1m", timeout: float = 30.0) -> None:
        """Until every series of `metric` has at least n scraped samples in the window."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.query(f"min(count_over_time({metric}[{window}]))")["result"]
            if res and float(res[0]["value"][1]) >= n:
                return
            time.sleep(0.2)
        raise TimeoutError(f"fewer than {n} samples of {metric} after {timeout}s")

    def wait_for_rule(self, record: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query(record)["result"]:
                return
            time.sleep(0.2)
        raise TimeoutError(f"recording rule {record} has no data after {timeout}s")
