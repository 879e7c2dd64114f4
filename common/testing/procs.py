"""Start and drive endpoint processes (kvpush_common.testing.peer_proc) over JSON lines."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent


class PeerError(RuntimeError):
    pass


class PeerProcess:
    def __init__(self, name: str, env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvpush-{name}-", suffix=".log", delete=False)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "NIXL_LOG_LEVEL": "WARN", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "peer_proc.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=full_env)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""

    def call(self, op: str, timeout: float = 60.0, **kw) -> dict:
        self.proc.stdin.write(msgspec.json.encode({"op": op, **kw}) + b"\n")
        self.proc.stdin.flush()
        while b"\n" not in self._buf:
            if not self._sel.select(timeout):
                raise PeerError(f"{self.name}: no reply to {op} within {timeout} s; log: {self.tail()}")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise PeerError(f"{self.name} exited (rc={self.proc.poll()}) during {op}; log: {self.tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = msgspec.json.decode(line)
        if not reply.get("ok"):
            raise PeerError(f"{self.name}.{op}: {reply.get('error')}\n{reply.get('trace', '')}")
        return reply

    def tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log.name).read_text()[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=15)
            except (PeerError, OSError, ValueError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)
