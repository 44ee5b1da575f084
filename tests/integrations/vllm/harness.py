"""Drive vLLM engines (``engine_proc.py``) and kvtier servers from tests, each in its own process."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MARK = "KVTIER-REPLY "


class EngineDied(RuntimeError):
    pass


class Engine:
    """A vLLM engine in a subprocess; ``call`` sends one command and returns its reply."""

    def __init__(self, settings: dict, log_path: Path, *, env: dict | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_proc.py"), json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._replies.put(None)

    def wait_ready(self, timeout: float = 240) -> None:
        self._reply(timeout)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 240) -> dict:
        return self._reply(timeout)

    def call(self, timeout: float = 240, **cmd) -> dict:
        self.send(**cmd)
        return self._reply(timeout)

    def _reply(self, timeout: float) -> dict:
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise EngineDied(f"no reply in {timeout}s; log: {self.log_path}\n{self.tail()}") from None
        if got is None:
            raise EngineDied(f"engine exited ({self.proc.poll()}); log: {self.log_path}\n{self.tail()}")
        return got

    def generate(self, prompts, *, sequential: bool = True, **kw) -> list[dict]:
        """Outputs of ``prompts``; ``sequential`` (one request at a time) keeps results bit-comparable."""
        return self.call(op="generate", prompts=prompts, sequential=sequential, **kw)["outputs"]

    def tail(self, n: int = 40) -> str:
        self._log.flush()
        return "".join(Path(self.log_path).read_text(errors="replace").splitlines(True)[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="quit", timeout=60)
            except (EngineDied, BrokenPipeError, OSError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids (above the special tokens 0..2) of a locally built 2048-token vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(length + 37 * i)] for i in range(n)]


def loaded_tokens(output: dict) -> int:
    return (output.get("kv_transfer_params") or {}).get("kvtier_loaded_tokens", 0)
