"""Building and loading the attention kernel (``kernels/verify_attention.c``).

The kernel is compiled once per machine with the system C compiler (``cc -O3 -mavx2 -mfma
-fopenmp``, about a second) into ``$VLLM_TOKENSWIFT_CACHE/kernels`` (default
``~/.cache/vllm-tokenswift/kernels``) and loaded with :mod:`ctypes` after torch, so it shares
torch's OpenMP runtime (thread count and core binding of vLLM's CPU worker). Where there is
no compiler, no AVX2/FMA or the build fails, :func:`load_kernel` returns ``None`` with the
reason and vLLM's own attention stays in use.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("vllm_tokenswift")

KERNEL_SOURCE = Path(__file__).parent / "verify_attention.c"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11")

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_kernel_error: str | None = None
_loaded = False


def kernel_cache_dir() -> Path:
    """Where the compiled kernel is kept: ``$VLLM_TOKENSWIFT_CACHE/kernels`` or
    ``~/.cache/vllm-tokenswift/kernels``."""
    root = os.environ.get("VLLM_TOKENSWIFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-tokenswift")
    return Path(root) / "kernels"


def cpu_supports_kernel() -> str | None:
    """``None`` when this CPU runs the kernel (x86-64 with AVX2 and FMA), else why not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the verification kernel is x86-64 only (this is {platform.machine()})"
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "").split()
    except OSError:
        flags = []
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _build(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([_compiler(), *CFLAGS, "-o", tmp, str(KERNEL_SOURCE), "-lm"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{_compiler()} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders (TP ranks) race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel_path() -> Path:
    """The compiled library's path: keyed by the source, the flags and the compiler."""
    h = hashlib.sha256(KERNEL_SOURCE.read_bytes())
    h.update(" ".join((_compiler(), *CFLAGS)).encode())
    return kernel_cache_dir() / f"verify_attention-{h.hexdigest()[:16]}.so"


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument and return types of ``tokenswift_verify_attention_f32`` on a
    loaded build of ``kernels/verify_attention.c`` (as :func:`verify_attention` calls it);
    returns ``lib``. Raises ``AttributeError`` when the library lacks the symbol."""
    fn = lib.tokenswift_verify_attention_f32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.argtypes = [p, i64, p, i64, p, p, i64, p, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32, p]
    fn.restype = ctypes.c_int
    return lib


def load_kernel() -> ctypes.CDLL | None:
    """Compile (once per machine) and load the kernel; ``None`` when it cannot run here
    (:func:`kernel_error` says why). Thread-safe; the outcome is cached per process."""
    global _kernel, _kernel_error, _loaded
    with _lock:
        if _loaded:
            return _kernel
        _loaded = True
        reason = cpu_supports_kernel()
        if reason is None:
            try:
                path = kernel_path()
                if not path.is_file():
                    _build(path)
                _kernel = bind(ctypes.CDLL(str(path)))
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                reason = f"the verification kernel could not be built or loaded: {e}"
        _kernel_error = reason
        if reason is not None:
            logger.info("TokenSwift: %s; vLLM's CPU attention verifies drafts", reason)
        return _kernel


def kernel_error() -> str | None:
    """Why :func:`load_kernel` returned ``None`` (``None`` while it has not failed)."""
    return _kernel_error


