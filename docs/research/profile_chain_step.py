"""Where a drafting step's time goes at a long context: cProfile of an in-process engine (the
worker runs in this process, so the proposer, the draft forward and vLLM's sampler are in
the profile), the demo model, the paper's sampling, one request.

    python docs/research/profile_chain_step.py CONTEXT METHOD [TOKENS]

METHOD: ``ar`` (plain decoding on the plugin's kernel, ``ar-vk``), ``tokenswift``
(adaptive), ``triforce1`` / ``triforce2`` (a self-speculative chain of 1 / 2 draft forwards
every step). Prints ms per token, the plugin's counters and the costliest calls (the
chain's and the proposer's callees). Fed docs/bench/long (self-speculative chains)."""
import argparse
import cProfile
import os
import pstats
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("context", type=int, help="prompt tokens (from the bundled book openings, repeated)")
ap.add_argument("method", choices=["ar", "tokenswift", "triforce1", "triforce2"])
ap.add_argument("tokens", type=int, nargs="?", default=256, help="tokens generated in the profiled run")
args = ap.parse_args()
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from vllm_tokenswift.cli.assets import DEMO_HEADS, DEMO_MODEL, PROMPTS_DIR
from vllm_tokenswift.cli.models import yarn_overrides
from vllm_tokenswift.engine.stats_rpc import get_engine_stats

ctx, method, ntok = args.context, args.method, args.tokens
tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
text = "\n\n".join(p.read_text() for p in sorted(PROMPTS_DIR.glob("*.txt")))
ids = tok(text, add_special_tokens=False)["input_ids"]
while len(ids) < ctx: ids = ids + ids
prompt = [{"prompt_token_ids": ids[-ctx:]}]
sp = SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, max_tokens=ntok, ignore_eos=True,
                    extra_args={"repetition_penalty_window": 1024})
ts = {"kv_budget": 1024}
if method == "triforce1": ts.update(policy="triforce", use_heads=False, ngram_topk=0, chain_length=1)
if method == "triforce2": ts.update(policy="triforce", use_heads=False, ngram_topk=0, chain_length=2)
spec = None if method == "ar" else {"method": "tokenswift", "model": str(DEMO_HEADS), "num_speculative_tokens": 4, "tokenswift": ts}
kw = dict(model=str(DEMO_MODEL), dtype="float32", max_model_len=ctx + 2048, enforce_eager=True,
          kv_cache_memory_bytes=1024 * 2**20, seed=0, hf_overrides=yarn_overrides(DEMO_MODEL, 2.0 if ctx < 30000 else 5.0),
          additional_config={"tokenswift_verify_attention": "auto"} if spec is None else None)
if kw["additional_config"] is None: del kw["additional_config"]
llm = LLM(speculative_config=spec, **kw) if spec else LLM(**kw)
llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
t = time.perf_counter()
pr = cProfile.Profile(); pr.enable()
out = llm.generate(prompt, sp, use_tqdm=False)
pr.disable()
dt = time.perf_counter() - t
n = len(out[0].outputs[0].token_ids)
print(f"{method} ctx {ctx}: {n} tokens in {dt:.2f}s = {1e3*dt/n:.1f} ms/token")
if spec:
    s = get_engine_stats(llm)
    print({k: s.get(k) for k in ("steps_by_kind", "chain_forwards", "accepted_tokens", "verified_drafts", "time_draft_s", "time_draft_forward_s", "time_total_s")})
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(18); st.print_callees("_chain"); st.print_callees("propose_step"); st.print_callees("draft_distributions")
