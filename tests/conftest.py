"""Suite-wide pytest configuration.

In-process engines, two workers
===============================
Offline engines (``vllm.LLM``) in this process run in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` makes vLLM use its in-process engine client and,
on CPU, the uni-process executor (the worker is this process). An engine then starts in
about 3 s instead of about 30 s (two spawned processes that each import vLLM), which was
a third of the suite's time. vLLM's multiprocess path stays covered: every OpenAI-server
test runs ``vllm-tokenswift serve`` as its own process tree (API server, engine core,
worker), the tensor-parallel engines run their two workers as processes, and
``tests/server_utils.py`` removes the variable from the servers' environment. A test
that needs the multiprocess engine sets the variable itself.

Engine accounting
=================
Every engine the suite starts is counted per test: in-process ones by a wrapper on
``vllm.v1.engine.llm_engine.LLMEngine.__init__`` (installed by an import hook the
moment vLLM's module is first imported), engines in subprocesses (servers, CLI) by
their ``VLLM::EngineCore`` process, which a daemon thread looks for in ``/proc`` twice
a second (an engine takes seconds to start, so none is missed). The terminal summary
prints engines per test file; ``--engine-report PATH`` writes them as JSON.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Under pytest-xdist (./scripts/test.sh runs two workers), each worker process is pinned to
# a core of its own (every thread it has and will start, and the processes it spawns:
# servers, tensor-parallel ranks) and its engines use one OpenMP thread bound to that
# core. Two workers then run side by side at full speed; unpinned, each worker's main
# thread and OpenMP thread competed for both cores (four busy threads on two cores: the
# lossless files took 3x longer than in a serial run).
_XDIST = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _core = _cpus[int(_XDIST[2:]) % len(_cpus)]
    # the CPUs the worker had before its pinning (tests/test_tensor_parallel.py spreads its
    # two TP ranks over two of them)
    os.environ["TOKENSWIFT_TEST_CPUS"] = ",".join(map(str, _cpus))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_core)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for _tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(_tid), {_core})
        except OSError:
            pass
    try:  # torch may already be imported (its thread pool sized before the pinning)
        import torch as _torch

        _torch.set_num_threads(1)
    except ImportError:
        pass

# Test-process workaround for a vLLM bug (0.32 and 0.33, vllm/triton_utils/dispatcher.py
# _rebind_kernels): every in-process CPU engine start re-registers vLLM's C++ kernel overrides,
# whose scan over sys.modules calls vars(value).get("kernel") on any value answering
# hasattr(value, "__dict__"). llvmlite's ffi.lib (imported with numba by vLLM's n-gram
# proposer) answers every attribute through __getattr__, "__dict__" with a C-function wrapper,
# so once an n-gram engine ran in a test worker, the next engine start there raised
# AttributeError. Giving ffi.lib an empty "__dict__" entry in its function table makes the scan
# skip it. Test-only: vLLM's default engines start their workers in fresh processes. It can go
# once vLLM's scan tolerates such objects (unchanged in 0.33).
try:
    import llvmlite.binding.ffi as _llvmlite_ffi

    _llvmlite_ffi.lib._fntab.setdefault("__dict__", {})
except (ImportError, AttributeError):
    pass

#: test files by how long they take (seconds in a serial run), heaviest first: collected in
#: this order, so that xdist hands the long files out first and the two workers finish
#: together (files not listed follow in their usual order)
HEAVY_FILES = ("test_openai_server.py", "test_tensor_parallel.py", "test_engine_lossless_llama.py",
               "test_engine_lifecycle.py", "test_engine_sampled.py", "test_serve_faults.py",
               "test_engine_lossless_chunked.py", "test_engine_compiled.py", "test_engine_long_context.py",
               "test_serve_cli.py", "test_engine_lossless_qwen.py", "test_models.py", "test_startup_errors.py",
               "test_engine_verify_opt_in.py", "test_packaging.py", "test_examples.py")

_PROC = Path("/proc")
_LLM_ENGINE = "vllm.v1.engine.llm_engine"


def pytest_addoption(parser):
    parser.addoption("--engine-report", default=None,
                     help="write the number of vLLM engines each test file started (JSON)")


class _EngineCounter:
    def __init__(self) -> None:
        self.current = "(collection)"
        self.per_test: Counter[str] = Counter()
        self._seen: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-counter", daemon=True)

    def start(self) -> None:
        if _PROC.is_dir():
            self._seen = self._engine_pids()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
            self._poll()

    def count(self, n: int = 1) -> None:
        with self._lock:
            self.per_test[self.current] += n

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
            self.count(len(new))

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


_COUNTER = _EngineCounter()


def _wrap_llm_engine(module) -> None:
    cls = module.LLMEngine
    orig = cls.__init__

    def __init__(self, *args, **kwargs):
        _COUNTER.count()
        return orig(self, *args, **kwargs)

    cls.__init__ = __init__


class _LLMEngineHook(importlib.abc.MetaPathFinder):
    """Wraps ``LLMEngine.__init__`` right after vLLM's module is executed."""

    def find_spec(self, name, path, target=None):
        if name != _LLM_ENGINE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap_llm_engine(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda it: rank.get(Path(str(it.fspath)).name, len(HEAVY_FILES)))


def pytest_sessionstart(session):
    if _LLM_ENGINE in sys.modules:
        _wrap_llm_engine(sys.modules[_LLM_ENGINE])
    else:
        sys.meta_path.insert(0, _LLMEngineHook())
    _COUNTER.start()


def pytest_runtest_logstart(nodeid, location):
    if _PROC.is_dir():
        _COUNTER._poll()
    _COUNTER.current = nodeid


def pytest_sessionfinish(session, exitstatus):
    # an xdist worker hands its counts to the controller (pytest_testnodedown)
    if hasattr(session.config, "workeroutput"):
        _COUNTER.stop()
        session.config.workeroutput["tokenswift_engines"] = json.dumps(dict(_COUNTER.per_test))


def pytest_testnodedown(node, error):
    data = getattr(node, "workeroutput", {}).get("tokenswift_engines")
    if data:
        with _COUNTER._lock:
            _COUNTER.per_test.update(json.loads(data))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
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
