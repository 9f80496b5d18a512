"""Patches of vLLM's step outputs (runner, scheduler, engine core): on TokenSwift engines
without async scheduling the step's draft token ids ride with the model runner's output
instead of a second RPC (``draft-ids-in-output``).
"""

from __future__ import annotations

from vllm_tokenswift.compat.patching import Patch, Target
from vllm_tokenswift.patches.common import _CPU_RUNNER, _RUNNER, _V32
from vllm_tokenswift.core.config import is_tokenswift_spec


# ------------------------------------------------------------------ draft-ids-in-output
#: attribute of a ModelRunnerOutput / the scheduler carrying the step's draft token ids
_DRAFTS_ATTR = "_tokenswift_draft_token_ids"
_SCHED = "vllm.v1.core.sched.scheduler"
_CORE = "vllm.v1.engine.core"


def _patch_drafts_in_output(orig: dict) -> dict:
    orig_sample = orig[f"{_RUNNER}:GPUModelRunner.sample_tokens"]
    orig_update = orig[f"{_SCHED}:Scheduler.update_from_output"]
    orig_post = orig[f"{_CORE}:EngineCore.post_step"]
    import copy

    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    def sample_tokens(self, grammar_output):
        out = orig_sample(self, grammar_output)
        if (type(out) is ModelRunnerOutput and out.req_ids and not self.use_async_scheduling
                and is_tokenswift_spec(self.speculative_config)):
            drafts = self.take_draft_token_ids()
            if drafts is not None:   # the runner's req_ids list is live: freeze it
                drafts = DraftTokenIds(list(drafts.req_ids), drafts.draft_token_ids)
            out = copy.copy(out)     # never tag a shared constant output
            setattr(out, _DRAFTS_ATTR, drafts)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        if hasattr(model_runner_output, _DRAFTS_ATTR):
            setattr(self, _DRAFTS_ATTR, (getattr(model_runner_output, _DRAFTS_ATTR),))
        return orig_update(self, scheduler_output, model_runner_output)

    def post_step(self, model_executed):
        carried = self.scheduler.__dict__.pop(_DRAFTS_ATTR, None)
        if carried is not None and self.check_for_draft_tokens and not self.async_scheduling \
                and model_executed:
            if carried[0] is not None:
                self.scheduler.update_draft_token_ids(carried[0])
            return None
        return orig_post(self, model_executed)

    return {f"{_RUNNER}:GPUModelRunner.sample_tokens": sample_tokens,
            f"{_SCHED}:Scheduler.update_from_output": update_from_output,
            f"{_CORE}:EngineCore.post_step": post_step}


#: this subsystem's patches, in the order they are applied
PATCHES: tuple[Patch, ...] = (
    Patch(
        name="draft-ids-in-output",
        targets=(Target(f"{_RUNNER}:GPUModelRunner.sample_tokens", "method",
                        f"{_RUNNER}.GPUModelRunner.sample_tokens", ("self", "grammar_output"),
                        (_CPU_RUNNER,)),
                 Target(f"{_SCHED}:Scheduler.update_from_output", "method",
                        f"{_SCHED}.Scheduler.update_from_output",
                        ("self", "scheduler_output", "model_runner_output")),
                 Target(f"{_CORE}:EngineCore.post_step", "method", f"{_CORE}.EngineCore.post_step",
                        ("self", "model_executed"))),
        reads=(Target(f"{_RUNNER}:GPUModelRunner.take_draft_token_ids", "method",
                      f"{_RUNNER}.GPUModelRunner.take_draft_token_ids", ("self",)),),
        build=_patch_drafts_in_output,
        required=False,
        changes="on TokenSwift engines without async scheduling, the runner's sample_tokens attaches "
                "the step's draft token ids (take_draft_token_ids) to a copy of its ModelRunnerOutput; "
                "the scheduler keeps them when it processes that output, and EngineCore.post_step "
                "hands them to Scheduler.update_draft_token_ids instead of asking the executor "
                "for them in a second RPC. Without the tag (other engines, a worker without the "
                "patch) post_step is vLLM's",
        why="with the multiprocess executor (always on CPU) every step of a speculative engine "
            "makes one more round trip to the worker after the output came back; with the "
            "adaptive policy running plain steps where drafting does not pay, that round trip "
            "is most of what a draft-free step costs above plain decoding",
        upstream="vLLM returns draft ids in the step output only with async scheduling; no "
                 "upstream issue filed from here",
        remove_when="vLLM returns draft token ids with the model runner output",
        versions={"0.32": _V32,
                  "0.33": "checked against the 0.33.0 wheel's source: the three targets and "
                          "take_draft_token_ids have the same signatures and post_step the same body"},
    ),
)
