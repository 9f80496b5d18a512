"""Suite-wide pytest configuration.

Engine accounting: vLLM names each engine-core process ``VLLM::EngineCore...``
(``vllm.utils.system_utils.set_process_title``), whether it belongs to an offline
``LLM``, an OpenAI server or a CLI subprocess. A daemon thread polls ``/proc`` twice a
second and attributes every new engine-core process to the test running when it
appeared (an engine takes 10+ s to start, so none is missed). The terminal summary
prints engines per test file; ``--engine-report PATH`` also writes them as JSON. The
poller is off where ``/proc`` is missing (it only counts; no test depends on it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

_PROC = Path("/proc")


def pytest_addoption(parser):
    parser.addoption("--engine-report", default=None,
                     help="write the number of vLLM engine-core processes each test file started (JSON)")


class _EngineCounter:
    def __init__(self) -> None:
        self.current = "(collection)"
        self.per_test: Counter[str] = Counter()
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-counter", daemon=True)

    def start(self) -> None:
        self._seen = self._engine_pids()  # engines that outlive nothing of ours
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._poll()

    @staticmethod
    def _engine_pids() -> set[int]:
        out = set()
        for p in _PROC.iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"VLLM::EngineCore"):
                out.add(int(p.name))
        return out

    def _poll(self) -> None:
        new = self._engine_pids() - self._seen
        if new:
            self._seen |= new
            self.per_test[self.current] += len(new)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._poll()
            except Exception:  # never disturb the suite
                pass

    def per_file(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for nodeid, n in self.per_test.items():
            out[nodeid.split("::")[0]] += n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


_COUNTER: _EngineCounter | None = None


def pytest_sessionstart(session):
    global _COUNTER
    if _PROC.is_dir() and os.environ.get("TOKENSWIFT_COUNT_ENGINES", "1") != "0":
        _COUNTER = _EngineCounter()
        _COUNTER.start()


def pytest_runtest_logstart(nodeid, location):
    if _COUNTER is not None:
        _COUNTER._poll()
        _COUNTER.current = nodeid


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _COUNTER is None:
        return
    _COUNTER.stop()
    per_file = _COUNTER.per_file()
    total = sum(per_file.values())
    terminalreporter.section(f"vLLM engines started: {total}")
    for f, n in per_file.items():
        terminalreporter.write_line(f"{n:4d}  {f}")
    path = config.getoption("--engine-report")
    if path:
        Path(path).write_text(json.dumps({"total": total, "per_file": per_file,
                                          "per_test": dict(_COUNTER.per_test),
                                          "time": time.time()}, indent=1))
