"""Building and loading the plugin's CPU kernel: the attention kernel
(``kernels/verify_attention.c``) and the native draft forward (``kernels/draft_forward.c``),
one library.

The kernel is compiled with the system C compiler (``$CC``, default ``cc``; ``-O3 -mavx2
-mfma -fopenmp``, about a second) into ``$VLLM_TOKENSWIFT_CACHE/kernels`` (default
``~/.cache/vllm-tokenswift/kernels``) under a name keyed by the source and the flags
(:func:`kernel_path`), and loaded with :mod:`ctypes` after torch, so it shares torch's
OpenMP runtime (thread count and core binding of vLLM's CPU worker).

Where it is built
=================
``scripts/setup.sh`` (CPU target) and the CPU Docker image build it ahead of time with
``python -m vllm_tokenswift.kernels`` (:mod:`vllm_tokenswift.kernels.__main__`), so a
machine or image without a compiler still finds it. Otherwise :func:`load_kernel` builds it
at first use. The compiler is deliberately not part of the file's name: a library built by
any C compiler from this source with these flags is interchangeable, so the image's build
stage (gcc) and its runtime (no compiler, any ``$CC``) compute the same path.

OpenMP runtime
==============
The library links ``libgomp.so.1`` (``readelf -d``: ``NEEDED libgomp.so.1``, ``libm.so.6``,
``libc.so.6``). torch's CPU wheel ships ``torch/lib/libgomp.so.1`` (SONAME ``libgomp.so.1``)
and loads it with ``libtorch_cpu.so``; the dynamic loader satisfies a ``NEEDED`` entry from
a library already loaded under that SONAME before it searches the disk, so once torch is
imported the kernel binds to torch's copy and no system libgomp is needed (the CPU image has
none). ``tests/test_verify_attention.py`` checks that only torch's copy is mapped.

Where there is no compiler (and no prebuilt file), no AVX2/FMA or the build fails,
:func:`load_kernel` returns ``None`` with the reason (:func:`kernel_status`) and vLLM's own
attention stays in use (:mod:`vllm_tokenswift.kernels.cpu_attention` logs why).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("vllm_tokenswift")

KERNEL_SOURCE = Path(__file__).parent / "verify_attention.c"
#: every source compiled into the library (the attention kernel first)
KERNEL_SOURCES = (KERNEL_SOURCE, Path(__file__).parent / "draft_forward.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11")

#: :attr:`KernelStatus.state` values
LOADED, FAILED, NOT_APPLICABLE = "loaded", "failed", "not-applicable"

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_kernel_error: str | None = None
_status: KernelStatus | None = None
_loaded = False


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled (no compiler, or the compiler failed)."""


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """What :func:`load_kernel` found in this process.

    ``state``: :data:`LOADED` (``path`` is the library in use), :data:`FAILED` (the kernel
    applies to this CPU but could not be built or loaded; ``reason`` says why) or
    :data:`NOT_APPLICABLE` (this CPU cannot run it: not x86-64, or no AVX2/FMA).
    ``built_now``: this process compiled it (no prebuilt file was there).
    """

    state: str
    path: Path | None
    reason: str | None = None
    built_now: bool = False

    def line(self) -> str:
        """One line for status output: ``loaded from PATH``, ``not loaded: WHY`` or
        ``not applicable on this platform: WHY``."""
        if self.state == LOADED:
            return f"loaded from {self.path}" + (" (built now)" if self.built_now else "")
        if self.state == NOT_APPLICABLE:
            return f"not applicable on this platform: {self.reason}"
        return f"not loaded: {self.reason}"


def kernel_cache_dir() -> Path:
    """Where the compiled kernel is kept: ``$VLLM_TOKENSWIFT_CACHE/kernels`` or
    ``$XDG_CACHE_HOME/vllm-tokenswift/kernels`` (``~/.cache/vllm-tokenswift/kernels``)."""
    root = os.environ.get("VLLM_TOKENSWIFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-tokenswift")
    return Path(root) / "kernels"


def is_x86_64() -> bool:
    """Whether this machine is x86-64 (the only architecture the kernel compiles for)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_supports_kernel() -> str | None:
    """``None`` when this CPU runs the kernel (x86-64 with AVX2 and FMA), else why not."""
    if not is_x86_64():
        return f"the verification kernel is x86-64 only (this is {platform.machine()})"
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "").split()
    except OSError:
        flags = []
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def compiler() -> str:
    """The C compiler the kernel is built with: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def build_kernel(out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile :data:`KERNEL_SOURCES` with :data:`CFLAGS` (plus ``extra_flags``) into ``out``,
    atomically (a temporary file renamed into place: concurrent builders, e.g. tensor-parallel
    ranks, race harmlessly).

    Raises:
        KernelBuildError: no compiler (``$CC``/``cc`` not found) or it failed (its stderr).
    """
    cc = compiler()
    if shutil.which(cc) is None:
        raise KernelBuildError(f"no C compiler: {cc!r} was not found (install one, e.g. gcc, or "
                               f"prebuild the kernel with `python -m vllm_tokenswift.kernels` where "
                               f"one is)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        try:
            r = subprocess.run([cc, *CFLAGS, *extra_flags, "-o", tmp, *map(str, KERNEL_SOURCES), "-lm"],
                               capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelBuildError(f"{cc} could not run: {e}") from e
        if r.returncode != 0:
            raise KernelBuildError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp makes it 0600; others (a container's user) load it too
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def kernel_path() -> Path:
    """The compiled library's path in :func:`kernel_cache_dir`: ``verify_attention-<key>.so``,
    the key a hash of the sources and :data:`CFLAGS` (not of the compiler, see the module
    doc)."""
    h = hashlib.sha256()
    for src in KERNEL_SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
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


def load_kernel(*, build: bool = True) -> ctypes.CDLL | None:
    """Load the kernel, compiling it first when no prebuilt file is at :func:`kernel_path`
    (unless ``build=False``); ``None`` when it cannot run here (:func:`kernel_status` and
    :func:`kernel_error` say why). Thread-safe; the outcome of the first call is kept for
    the process. Never raises for a missing compiler or a failed build or load."""
    global _kernel, _kernel_error, _status, _loaded
    if _loaded:  # every attention layer calls this: no lock once decided
        return _kernel
    with _lock:
        if _loaded:
            return _kernel
        reason = cpu_supports_kernel()
        if reason is not None:
            _status = KernelStatus(NOT_APPLICABLE, None, reason)
        else:
            path = kernel_path()
            built = False
            try:
                if not path.is_file():
                    if not build:
                        raise KernelBuildError(f"no prebuilt kernel at {path} (building was not allowed)")
                    build_kernel(path)
                    built = True
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:
                    raise KernelBuildError(f"cannot load {path}: {e}") from e
                _kernel = bind(lib)
                _status = KernelStatus(LOADED, path, None, built)
            except (KernelBuildError, OSError, AttributeError) as e:
                reason = f"the verification kernel could not be built or loaded: {e}"
                _status = KernelStatus(FAILED, path, reason)
        _kernel_error = reason
        _loaded = True  # last: the lock-free path above must not see a decision half made
        logger.debug("TokenSwift verification kernel: %s", _status.line())
        return _kernel


def kernel_error() -> str | None:
    """Why :func:`load_kernel` returned ``None`` (``None`` while it has not failed)."""
    return _kernel_error


def kernel_status(*, build: bool = True) -> KernelStatus:
    """The kernel's :class:`KernelStatus` in this process, loading it first (and building it
    unless ``build=False``) if that has not happened yet."""
    load_kernel(build=build)
    assert _status is not None
    return _status

