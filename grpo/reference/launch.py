"""Start ``ref_client.py`` as a child process, wait until it is healthy, stop it gracefully.

Used by ``scripts/demo.py``, ``scripts/benchmarks/bench_ref.py`` and the tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

from grpo.foundation.dist import free_port  # noqa: F401  (re-exported: scripts and tests start servers on it)

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """``python ref_client.py ARGS --host HOST --port PORT`` with its log in ``log_path``."""

    def __init__(self, args: list[str], port: int, host: str = "127.0.0.1", token: Optional[str] = None,
                 log_path: Optional[str | Path] = None, env: Optional[dict[str, str]] = None):
        self.args, self.port, self.host, self.token = list(args), port, host, token
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        env = {**os.environ, **(self.env or {})}
        if self.token:
            env["GRPO_REF_TOKEN"] = self.token
        cmd = [sys.executable, str(ROOT / "ref_client.py"), *self.args, "--host", self.host, "--port", str(self.port)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if self.log_path:
            out.close()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the reference server exited with code {self.proc.returncode} before it was "
                                   f"healthy; log: {self.log_tail()}")
            try:
                if requests.get(self.url + "/health", headers=self.headers(), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the reference server at {self.url} was not healthy within {timeout:g} s; log: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no log file)"
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM (in-flight requests finish), then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        """SIGKILL: the abrupt death the trainer must survive."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
