"""The target model as the proposer uses it: its own forward over budgeted views, the hidden
states the heads read, block importance from the KV cache, and the cache's key layout.

This is the only proposer code that touches vLLM's model and runner internals
(``GPUModelRunner`` / ``CPUModelRunner`` of vLLM 0.32, see
``../shared/design/vllm-integration-notes.md`` §2-3):

* :meth:`TargetAccess.attach` installs forward hooks on the target: on its final
  norm (the pre-norm hidden state ``h_0`` the heads read, paper Sec 3.2); a
  pre-hook on every attention layer (the newest token's query, for block
  importance, Sec 3.3) is installed for the duration of each draft forward only,
  so verification forwards keep PyTorch's hook-free module call path. Hooks do nothing
  while a graph is being compiled (``torch.compiler.is_compiling()``), so a compiled or
  CUDA-graph verification forward is unaffected; the draft forward always runs eagerly
  (``skip_compiled=True``) so its hooks fire.
* :meth:`TargetAccess.draft_forward` runs the target for one token per request
  against per-request block tables (the budgeted views): vLLM's own attention
  metadata builders (``build_for_drafting``), ``set_forward_context`` with a
  per-layer metadata dict, the newest token's real slot in the slot mapping.
* On vLLM's CPU backend the draft forward runs natively once it can
  (:mod:`vllm_tokenswift.engine.native_draft`, setting ``draft_forward``): the engine's first
  draft forward goes through vLLM's model (it also finds the KV layout), the native
  forward then runs on the same inputs, and when the two agree (final hidden states within
  :data:`NATIVE_TOLERANCE`) every later draft forward is one C call over a packed bf16 or
  fp32 copy of the weights (:mod:`vllm_tokenswift.kernels.draft_forward`), its logits too
  (:meth:`TargetAccess.logits`). Otherwise vLLM's forward stays, with one log line saying why.
* :meth:`TargetAccess.verification_hidden` hands out the pre-norm hidden state
  the *verification* forward of this step computed at chosen token indices
  (fused heads, no extra forward). Available when that forward ran eagerly.
* :meth:`TargetAccess.importance` reads the keys of a request's blocks (only K,
  in the cache's own dtype, :mod:`vllm_tokenswift.engine.kv_cache`) and scores blocks
  with the captured query; :attr:`TargetAccess.query_rows` says whose queries the latest
  draft forward captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch

from vllm_tokenswift.core.kv_view import block_importance
from vllm_tokenswift.engine.kv_cache import KEY_READERS, detect_key_layout
from vllm_tokenswift.engine.tensor_parallel import tp_all_gather

logger = logging.getLogger("vllm_tokenswift")

#: largest relative L2 difference between the native and vLLM's final hidden states on the
#: first draft forward for the native forward to be used, by weight dtype (bf16 rounding of
#: every weight moves the hidden state by a few parts in a thousand; fp32 only by summation order)
NATIVE_TOLERANCE = {"bfloat16": 0.05, "float32": 1e-3}


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


class TargetAccess:
    """Hooks into the target model and runs its draft forward (see module doc).

    Args:
        vllm_config: the engine's ``VllmConfig``.
        block_size: KV block size in tokens.
        vocab_size: the target's vocabulary size (logits are cut to it).
        tp_size: tensor-parallel world size.
        draft_forward: ``"auto"``: the native draft forward where it applies (module doc);
            ``"vllm"``: always vLLM's model.
        draft_weights: the native forward's weight copy, ``"bfloat16"`` or ``"float32"``.
    """

    def __init__(self, vllm_config, block_size: int, vocab_size: int, tp_size: int = 1,
                 draft_forward: str = "auto", draft_weights: str = "bfloat16"):
        self.vllm_config = vllm_config
        self.draft_weights = draft_weights
        #: the packed decoder of the native draft forward, once it is on
        self.native = None
        #: ``"pending"`` (decided on the first draft forward), ``"on"`` or ``"off"``
        self.native_state = "pending" if draft_forward == "auto" else "off"
        #: why the native forward is off (None while pending or on)
        self.native_reason: str | None = None if draft_forward == "auto" else "draft_forward is 'vllm'"
        #: rows (request-forwards) the native draft forward has run
        self.native_rows = 0
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.tp_size = tp_size
        self.target = None
        self.layer_names: list[str] = []
        self.key_layout: str | None = None
        self._layout_checked = False
        self._in_draft = False
        self._prenorm: torch.Tensor | None = None      # of the draft forward
        self._verify_prenorm: torch.Tensor | None = None  # of the latest other (verification) forward
        self._q: dict[str, torch.Tensor] = {}
        #: request (``RequestState.uid``) -> its row in the latest draft forward's captured
        #: queries; empty when that forward captured none. The one record of which
        #: requests' queries are valid (block importance reads them, Sec 3.3).
        self.query_rows: dict[int, int] = {}
        self._probe_key: torch.Tensor | None = None
        self._hooks = []
        self._tables: dict = {}

    # ----------------------------------------------------------------- set-up
    def attach(self, target_model) -> None:
        """Install the final-norm hook and find the attention layers (whose query
        pre-hooks are installed for the duration of each draft forward).

        Raises:
            ValueError: the model has no ``model.norm`` or no attention layers.
        """
        self.target = target_model
        norm = getattr(getattr(target_model, "model", None), "norm", None)
        if norm is None:
            raise ValueError(f"{type(target_model).__name__} has no model.norm: TokenSwift needs a "
                             "Llama/Qwen2-style decoder (final norm before the LM head)")
        self._hooks.append(norm.register_forward_hook(self._norm_hook))
        from vllm.model_executor.layers.attention.attention import Attention

        ctx = self.vllm_config.compilation_config.static_forward_context
        names = [n for n, m in ctx.items() if isinstance(m, Attention)]
        if not names:
            raise ValueError("no attention layers found in the target model")
        self.layer_names = sorted(names, key=_layer_index)
        # The query pre-hooks are installed around each draft forward only (see
        # :meth:`_query_hooks`): a module with a hook takes PyTorch's slow call path,
        # which every verification forward would otherwise pay for 30+ layers.
        self._attn_modules = [ctx[name] for name in self.layer_names]

    def _norm_hook(self, module, inputs, output):
        if _compiling():
            return
        if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
            pre = output[1]                      # fused add + norm: (normed, x + residual)
        elif len(inputs) > 1 and inputs[1] is not None:
            pre = inputs[0] + inputs[1]
        else:
            pre = inputs[0]
        if self._in_draft:
            self._prenorm = pre
        else:
            self._verify_prenorm = pre

    def _query_hooks(self) -> list:
        """Install one query pre-hook per attention layer for the draft forward about to
        run; returns the handles (the caller removes them when the forward is done)."""
        mods = getattr(self, "_attn_modules", ())
        return [m.register_forward_pre_hook(self._make_attn_hook(name))
                for name, m in zip(self.layer_names, mods)]

    def _make_attn_hook(self, name: str):
        def hook(module, args):
            if self._in_draft and args and not _compiling():
                self._q[name] = args[0]
                if self._probe_key is None and name == self.layer_names[0] and len(args) > 1:
                    self._probe_key = args[1]
        return hook

    # ----------------------------------------------------------------- verification hidden states
    def verification_hidden(self, token_indices: list[int]) -> torch.Tensor | None:
        """Pre-norm hidden states of the latest verification forward at these flat token
        indices (``query_start_loc[row] + offset``), ``[n, H]``; None when that forward
        did not run eagerly (compiled / CUDA graph) or is already consumed."""
        h = self._verify_prenorm
        if h is None or not token_indices or max(token_indices) >= h.shape[0]:
            return None
        idx = torch.as_tensor(token_indices, dtype=torch.long, device=h.device)
        return h.index_select(0, idx)

    @property
    def has_verification_hidden(self) -> bool:
        """Whether this step's verification forward left its hidden states (eager run)."""
        return self._verify_prenorm is not None

    def end_step(self) -> None:
        """Drop the reference to this step's verification hidden states."""
        self._verify_prenorm = None

    # ----------------------------------------------------------------- draft forward
    def draft_forward(self, runner, token_ids: list[int], positions: list[int], slots: list[int],
                      tables: list[np.ndarray], seq_lens: list[int], request_uids: list[int]) -> torch.Tensor:
        """One forward of the target, one token per request, over budgeted views.

        Args:
            runner: vLLM's model runner (``attn_groups``, ``device``).
            token_ids: newest token of each request.
            positions: its position (RoPE uses the real position).
            slots: its real KV slot (``block_id · block_size + offset``).
            tables: per layer group (one entry: shared by all layers), ``[n, width]``
                int32 physical block ids of the views.
            seq_lens: logical length of each view in tokens (newest token included).
            request_uids: per row, the request's ``RequestState.uid`` (:attr:`query_rows`
                maps them to their rows afterwards).
        Returns:
            ``[n, H]``: the model output (final-normed hidden state); the pre-norm hidden
            state ``h_0`` (:attr:`draft_prenorm`) and each layer's query are captured.
        """
        if self.native is not None:
            return self._native_forward(token_ids, positions, slots, tables, seq_lens, request_uids)
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        n = len(token_ids)
        dev = runner.device
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        pos = torch.as_tensor(positions, dtype=torch.long)
        slot_t = torch.as_tensor(slots, dtype=torch.long)
        seq = torch.as_tensor(seq_lens, dtype=torch.int32)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        pos_d, slots_d = pos.to(dev), slot_t.to(dev)
        dev_tables = [torch.from_numpy(t).to(dev) for t in tables]
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev),
            seq_lens_cpu_upper_bound=seq, num_reqs=n, num_actual_tokens=n, max_query_len=1,
            max_seq_len=int(seq.max()), block_table_tensor=dev_tables[0], slot_mapping=slots_d,
            causal=True, positions=pos_d, is_prefilling=torch.zeros(n, dtype=torch.bool))
        per_layer = len(dev_tables) > 1
        layer_group = {name: i for i, name in enumerate(self.layer_names)} if per_layer else {}
        md, sm = {}, {}
        for groups in runner.attn_groups:
            for g in groups:
                builder = g.get_metadata_builder()
                if not per_layer:
                    m = builder.build_for_drafting(_kernel_blocks(g, cm), 0)
                    for ln in g.layer_names:
                        md[ln], sm[ln] = m, slots_d
                    continue
                for ln in g.layer_names:
                    t = dev_tables[layer_group.get(ln, 0)]
                    m = builder.build_for_drafting(_kernel_blocks(g, replace(cm, block_table_tensor=t)), 0)
                    md[ln], sm[ln] = m, slots_d
        self._q = {}
        self._prenorm = None
        probe = not self._layout_checked
        if probe:
            self._probe_key = None
        self._in_draft = True
        hooks = self._query_hooks()
        try:
            with set_forward_context(md, self.vllm_config, num_tokens=n, slot_mapping=sm,
                                     skip_compiled=True):
                hidden = self.target(input_ids=ids.to(dev), positions=pos_d)
        finally:
            self._in_draft = False
            for hk in hooks:
                hk.remove()
        if probe:
            self._detect_layout(int(slot_t[0]))
        self.query_rows = {uid: k for k, uid in enumerate(request_uids)} if self._q else {}
        h = hidden if isinstance(hidden, torch.Tensor) else hidden[0]
        if self.native_state == "pending":
            self._try_native(runner, token_ids, positions, slots, tables, seq_lens, h[:n])
        return h[:n]

    # ----------------------------------------------------------------- native draft forward
    def _try_native(self, runner, token_ids, positions, slots, tables, seq_lens, h_vllm) -> None:
        """Decide, once, whether later draft forwards run natively: build the packed decoder
        and run it on the inputs vLLM's forward just had (rewriting the same slots' K/V);
        on when the final hidden states agree within :data:`NATIVE_TOLERANCE`."""
        from vllm_tokenswift.engine.native_draft import build_packed_decoder, describe, unsupported_reason

        self.native_state = "off"
        try:
            reason = None
            if self.key_layout != "cpu_vec":
                reason = f"the KV cache layout is {self.key_layout or 'unknown'} (vLLM's CPU 'vec' layout only)"
            elif any(getattr(g, "kernel_block_size", None) not in (None, self.block_size)
                     for groups in runner.attn_groups for g in groups):
                reason = "the attention kernel's block size differs from the KV cache's"
            else:
                reason = unsupported_reason(self.target, self.vllm_config, self._attn_modules, self.tp_size)
            if reason is None:
                t = time.perf_counter()
                dec = build_packed_decoder(self.target, self.vllm_config, self._attn_modules, self.block_size,
                                           self.draft_weights)
                built = time.perf_counter() - t
                self.native = dec
                h_native = self._native_forward(token_ids, positions, slots, tables, seq_lens, None)
                err = float((h_native - h_vllm.float()).norm() / h_vllm.float().norm().clamp_min(1e-30))
                tol = NATIVE_TOLERANCE[self.draft_weights]
                if not err <= tol:
                    self.native = None
                    reason = (f"its first forward differs from vLLM's by {err:.3g} (relative L2 of the final "
                              f"hidden states; at most {tol:g} allowed)")
                else:
                    self.native_state = "on"
                    logger.info("TokenSwift: native draft forward on (%s, packed in %.1f s; first forward within "
                                "%.2g of vLLM's)", describe(dec), built, err)
                    return
        except Exception as e:  # noqa: BLE001 - any failure keeps vLLM's forward, said once
            self.native = None
            reason = f"{type(e).__name__}: {e}"
        self.native_reason = reason
        logger.info("TokenSwift: draft forward through vLLM's model (native draft forward off: %s)", reason)

    def _native_forward(self, token_ids, positions, slots, tables, seq_lens, request_uids) -> torch.Tensor:
        """The draft forward through :func:`~vllm_tokenswift.kernels.draft_forward.draft_forward`
        (same arguments and captures as :meth:`draft_forward`; ``request_uids`` None: the
        captures are left alone)."""
        from vllm_tokenswift.kernels.draft_forward import draft_forward

        emb = self.target.model.embed_tokens.weight
        x = emb.index_select(0, torch.as_tensor(token_ids, dtype=torch.long)).float()
        tabs = [torch.from_numpy(np.ascontiguousarray(t, dtype=np.int32)) for t in tables]
        pre, hidden, q = draft_forward(self.native, x, positions, slots, tabs, seq_lens,
                                       capture_queries=request_uids is not None and self.key_layout is not None)
        if request_uids is not None:
            self.native_rows += len(token_ids)
            self._prenorm = pre
            self._q = {name: q[i] for i, name in enumerate(self.layer_names)} if q is not None else {}
            self.query_rows = {uid: k for k, uid in enumerate(request_uids)} if self._q else {}
        return hidden
    @property
    def draft_prenorm(self) -> torch.Tensor | None:
        """``h_0`` of the latest draft forward, ``[n, H]`` (None if not captured)."""
        return self._prenorm

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (``compute_logits``) on ``[m, H]`` -> ``[m, V]`` float32.

        With the native draft forward on, the packed copy of the LM head computes them.

        Raises:
            RuntimeError: this rank received no logits (platform gathers on rank 0 only).
        """
        dec = self.native
        if dec is not None and dec.lm_head is not None:
            from vllm_tokenswift.kernels.draft_forward import packed_linear

            return packed_linear(dec.lm_head, dec.vocab_size, hidden.float())
        out = self.target.compute_logits(hidden)
        if out is None:
            raise RuntimeError("TokenSwift: compute_logits returned no logits on this rank")
        return out[..., : self.vocab_size].float()

    # ----------------------------------------------------------------- importance
    def importance(self, block_ids: np.ndarray, q_row: int, num_groups: int) -> list[np.ndarray] | None:
        """Per group, block importance (Eq. 2 per block) of ``block_ids`` (physical ids of
        blocks ``sink .. last-1`` of one request) from the query of its row ``q_row`` in
        the latest draft forward. None: layout unknown (recency fallback).

        Reads only the keys, in the cache's dtype (no V, no fp32 copy of the cache).
        """
        if self.key_layout is None:
            return None
        if block_ids.size == 0:
            return [np.zeros(0)] * num_groups
        ctx = self.vllm_config.compilation_config.static_forward_context
        reader = KEY_READERS[self.key_layout]
        per_layer = []
        ids = None
        for name in self.layer_names:
            kv = ctx[name].kv_cache
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            if ids is None:
                ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv.device)
            keys = reader(kv, ids)
            q = self._q[name][q_row]
            hq = q.numel() // keys.shape[-1]
            per_layer.append(block_importance(q.reshape(hq, keys.shape[-1]), keys))
        if num_groups == 1:
            return [torch.stack(per_layer).sum(0).cpu().numpy()]
        return [t.cpu().numpy() for t in per_layer]

    # ----------------------------------------------------------------- KV layout
    def _detect_layout(self, slot: int) -> None:
        """Find the KV cache key layout from the key the first draft forward wrote.

        With tensor parallelism the ranks agree (one collective, on the first draft
        forward, which all ranks run): if any rank cannot read its keys, all fall back
        to recency, so no rank skips the importance collective the others enter."""
        self._layout_checked = True
        layout = self._find_layout(slot)
        if self.tp_size > 1:
            ok = tp_all_gather(torch.tensor([1.0 if layout is not None else 0.0]))
            if layout is not None and bool((ok < 0.5).any()):
                logger.warning("TokenSwift: another tensor-parallel rank could not read its KV keys; "
                               "view selection falls back to recency on all ranks")
                layout = None
        self.key_layout = layout
        if layout is not None:
            logger.info("TokenSwift: KV cache key layout %s", layout)

    def _find_layout(self, slot: int) -> str | None:
        key = self._probe_key
        if key is None:
            logger.warning("TokenSwift: could not capture a key; view selection falls back to recency")
            return None
        ctx = self.vllm_config.compilation_config.static_forward_context
        kv = ctx[self.layer_names[0]].kv_cache
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        hkv = kv.shape[1] if kv.dim() == 4 else None
        k = key[0]
        d = None
        for cand in (kv.shape[-1] // 2, kv.shape[-1]):
            if hkv and k.numel() == hkv * cand:
                d = cand
                break
        if d is None:
            logger.warning("TokenSwift: unknown KV cache shape %s; view selection uses recency",
                           tuple(kv.shape))
            return None
        layout = detect_key_layout(kv, slot, self.block_size, k.reshape(hkv, d))
        if layout is None:
            logger.warning("TokenSwift: KV cache layout not recognised (shape %s); view selection "
                           "falls back to recency", tuple(kv.shape))
        return layout


def _kernel_blocks(group, cm):
    """Map manager block ids to kernel block ids (a private copy, so per-layer tables
    do not share vLLM's scratch buffer)."""
    if getattr(group, "kernel_block_size", None) is None:
        return cm
    mapped = group.map_to_kernel_block_table(cm.block_table_tensor).clone()
    return replace(cm, block_table_tensor=mapped)


def _layer_index(name: str) -> tuple:
    parts = []
    for tok in name.split("."):
        parts.append((0, int(tok), "") if tok.isdigit() else (1, 0, tok))
    return tuple(parts)
