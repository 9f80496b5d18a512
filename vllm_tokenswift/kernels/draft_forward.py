"""The draft forward in one C call (``kernels/draft_forward.c``): a Llama/Qwen2-style decoder
for one token per request over budgeted views of vLLM's CPU paged KV cache, with the weights in
a packed bf16 (or fp32) copy.

Why it exists
=============
TokenSwift's draft forward (paper Sec 3.3) and the self-speculative chains' forwards run the
target for one token per request over a budgeted view of its KV cache. Through vLLM's eager
model path one such forward cost 7-9 ms on the demo model at every context length on one AVX2
core (docs/bench/long, the cost probe): about 4 ms of oneDNN matmuls over 50 MB of fp32
weights, the rest per-op work of an eager PyTorch forward. That made a chain forward 0.2x a
plain decode step at a 64K context and half of one at 16K, so drafting from the target barely
paid. :func:`draft_forward` does the same computation in one call: each linear layer one pass
over a packed copy of its weight for all rows (:func:`pack_weight`), every other op a loop over
the row, the attention through :func:`tokenswift_verify_attention_f32
<vllm_tokenswift.kernels.verify_attention.verify_attention>`. With bf16 weights it reads half
the bytes. The draft only has to be close to the target: vLLM's rejection sampler verifies
every draft token against the full model, so the output is unchanged either way (the
acceptance rate is what precision can move, and the test suite measures it).

:class:`PackedDecoder` holds the packed weights and the ``tsd_model`` struct; building one from
a vLLM model is :mod:`vllm_tokenswift.engine.native_draft`. :func:`reference_draft_forward` is
the plain PyTorch definition the kernel is tested against.

Layout
======
A weight ``W [N, K]`` (``y = x W^T``) is packed as ``[ceil(N / 16), K, 16]``: panel ``p`` holds
output rows ``16 p .. 16 p + 15`` (zero past ``N``), ``K``-major. bf16 values are the fp32
values rounded to nearest even (``Tensor.to(torch.bfloat16)``). The KV cache is vLLM's CPU
"vec" layout (see :mod:`vllm_tokenswift.kernels.verify_attention`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch

from vllm_tokenswift.kernels.build import kernel_error, load_kernel

#: ``wdtype`` codes of the C side
WEIGHT_DTYPES = {"float32": 0, "bfloat16": 1}
_TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: return codes of ``tokenswift_draft_forward`` besides the attention's own (``TS_E_*``)
DRAFT_ERROR_MESSAGES = {
    -101: "a model dimension is not positive, or rot_dim is odd or larger than head_dim",
    -102: "the weight dtype code is neither 0 (float32) nor 1 (bfloat16)",
    -103: "no rows, or a position outside the rotary table, or a negative slot",
    -104: "out of memory: the forward's work buffers could not be allocated",
}


class DraftForwardError(RuntimeError):
    """The native draft forward refused its arguments (the Python checks or the C side's
    return code)."""


def pack_weight(w: torch.Tensor, dtype: str = "bfloat16") -> torch.Tensor:
    """Pack ``w`` ``[N, K]`` (float32, ``y = x w^T``) into panels of 16 output rows.

    Returns a contiguous ``[ceil(N / 16), K, 16]`` tensor of ``dtype`` (``"bfloat16"``:
    round to nearest even, each panel row's 16 columns stored interleaved ``0, 8, 1, 9, ...,
    7, 15`` for the C side's widening; ``"float32"``: an exact copy), rows past ``N`` zero.

    Raises:
        ValueError: ``w`` is not a 2-D floating tensor, or ``dtype`` is not in
            :data:`WEIGHT_DTYPES`.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"a weight to pack must be a 2-D floating tensor, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    panels = -(-n // 16)
    full = torch.zeros(panels * 16, k, dtype=torch.float32)
    full[:n] = w.detach().to(device="cpu", dtype=torch.float32)
    out = full.view(panels, 16, k).transpose(1, 2)
    if dtype == "bfloat16":
        out = out[..., _BF16_ORDER]
    return out.contiguous().to(_TORCH_DTYPE[dtype])


#: a bf16 panel row's column order (the C side widens even and odd halves separately)
_BF16_ORDER = torch.tensor([c for j in range(8) for c in (j, j + 8)])
_BF16_INVERSE = torch.argsort(_BF16_ORDER)


def unpack_weight(p: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, K]`` float32 weight a packed tensor holds (inverse of :func:`pack_weight`,
    exact for float32, the rounded values for bfloat16)."""
    panels, k, _ = p.shape
    v = p.float()
    if p.dtype == torch.bfloat16:
        v = v[..., _BF16_INVERSE]
    return v.transpose(1, 2).reshape(panels * 16, k)[:n].contiguous()


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("ln1", "w_qkv", "b_qkv", "w_o", "b_o", "ln2", "w_gu", "b_gu", "w_down", "b_down", "kv_cache")]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in
                ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter", "block_size",
                 "rot_dim", "neox", "wdtype")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("max_pos", ctypes.c_int64),
        ("cos_sin", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer))]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    if getattr(lib, "_tokenswift_draft_bound", False):
        return lib
    p, i32 = ctypes.c_void_p, ctypes.c_int32
    fn = lib.tokenswift_draft_forward
    fn.argtypes = [ctypes.POINTER(_Model), i32, p, p, p, p, p, p, p, p, p]
    fn.restype = ctypes.c_int
    lin = lib.tokenswift_packed_linear
    lin.argtypes = [p, i32, p, p, i32, i32, i32, p]
    lin.restype = ctypes.c_int
    lib._tokenswift_draft_bound = True
    return lib


def _kernel() -> ctypes.CDLL:
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(kernel_error() or "the plugin's CPU kernel is not loaded")
    return _bind(lib)


def _error(rc: int) -> str:
    from vllm_tokenswift.kernels.verify_attention import error_message

    return DRAFT_ERROR_MESSAGES.get(rc) or error_message(rc)


def _f32(t: torch.Tensor | None, shape: tuple, name: str) -> torch.Tensor | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_cpu or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be a float32 CPU tensor of shape {shape}, got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return t.contiguous()


def _packed(t: torch.Tensor, n: int, k: int, dtype: str, name: str) -> torch.Tensor:
    if t.dtype != _TORCH_DTYPE[dtype] or tuple(t.shape) != (-(-n // 16), k, 16) or not t.is_contiguous():
        raise ValueError(f"{name} must be a packed {dtype} weight of shape {(-(-n // 16), k, 16)} "
                         f"(pack_weight of [{n}, {k}]), got {tuple(t.shape)} {t.dtype}")
    return t


@dataclass(frozen=True, eq=False)
class DecoderLayerWeights:
    """One decoder layer for :class:`PackedDecoder`: RMSNorm weights ``ln1``/``ln2`` ``[H]``,
    packed weights ``qkv`` (``[(Hq + 2 Hkv) D, H]``: q rows, then k, then v), ``o`` (``[H, Hq
    D]``), ``gate_up`` (``[2 I, H]``: gate rows, then up), ``down`` (``[H, I]``), optional fp32
    biases, and the layer's KV cache (``[num_blocks, Hkv, block_size, 2 D]`` float32, vec layout).
    Frozen: :class:`PackedDecoder` hands the C side pointers to these very tensors."""

    ln1: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    kv_cache: torch.Tensor
    b_qkv: torch.Tensor | None = None
    b_o: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class PackedDecoder:
    """A Llama/Qwen2-style decoder packed for :func:`draft_forward`.

    Args:
        layers: per decoder layer, :class:`DecoderLayerWeights`.
        final_norm: ``[H]`` the final RMSNorm's weight.
        cos_sin: ``[max_pos, rot_dim]`` float32, vLLM's rotary ``cos_sin_cache`` (cos of the
            ``rot_dim / 2`` frequencies, then sin).
        hidden, num_heads, num_kv_heads, head_dim, intermediate: the decoder's sizes.
        block_size: the KV cache's block size in tokens.
        eps: the RMSNorms' epsilon; scale: the attention's softmax scale.
        neox: NeoX-style rotary pairing (``i, i + rot_dim / 2``), else GPT-J (``2i, 2i + 1``).
        weight_dtype: ``"bfloat16"`` or ``"float32"`` (every packed weight's dtype).

    Frozen, like its layers: the C struct built here points at these tensors (a contiguous
    copy is kept where a tensor was not contiguous).

    Raises:
        ValueError: a tensor's dtype or shape does not fit the sizes (checked here once, so the
            per-call checks of :func:`draft_forward` are O(rows)).
    """

    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    cos_sin: torch.Tensor
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    eps: float
    scale: float
    neox: bool = True
    weight_dtype: str = "bfloat16"
    lm_head: torch.Tensor | None = None
    vocab_size: int = 0
    _struct: _Model = field(init=False, repr=False)
    _layer_array: ctypes.Array = field(init=False, repr=False)

    def __post_init__(self):
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        h, hq, hkv, d, i = self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate
        if min(h, hq, hkv, d, i, self.block_size) < 1 or hq % hkv or d % 32 or self.block_size % 16:
            raise ValueError(f"sizes do not fit: hidden {h}, heads {hq}/{hkv}, head_dim {d} (a multiple "
                             f"of 32), intermediate {i}, block_size {self.block_size} (a multiple of 16)")
        if not self.layers:
            raise ValueError("a decoder needs at least one layer")
        dt = self.weight_dtype
        if self.cos_sin.dim() != 2 or self.cos_sin.dtype != torch.float32 or self.cos_sin.shape[1] % 2 \
                or self.cos_sin.shape[1] > d:
            raise ValueError(f"cos_sin must be float32 [max_pos, rot_dim] with an even rot_dim <= {d}, got "
                             f"{tuple(self.cos_sin.shape)} {self.cos_sin.dtype}")
        set_ = object.__setattr__
        set_(self, "cos_sin", self.cos_sin.contiguous())
        set_(self, "final_norm", _f32(self.final_norm, (h,), "final_norm"))
        arr = (_Layer * len(self.layers))()
        qkv_n = (hq + 2 * hkv) * d
        for li, ly in enumerate(self.layers):
            set_(ly, "ln1", _f32(ly.ln1, (h,), f"layer {li} ln1"))
            set_(ly, "ln2", _f32(ly.ln2, (h,), f"layer {li} ln2"))
            _packed(ly.qkv, qkv_n, h, dt, f"layer {li} qkv")
            _packed(ly.o, h, hq * d, dt, f"layer {li} o")
            _packed(ly.gate_up, 2 * i, h, dt, f"layer {li} gate_up")
            _packed(ly.down, h, i, dt, f"layer {li} down")
            set_(ly, "b_qkv", _f32(ly.b_qkv, (qkv_n,), f"layer {li} b_qkv"))
            set_(ly, "b_o", _f32(ly.b_o, (h,), f"layer {li} b_o"))
            set_(ly, "b_gate_up", _f32(ly.b_gate_up, (2 * i,), f"layer {li} b_gate_up"))
            set_(ly, "b_down", _f32(ly.b_down, (h,), f"layer {li} b_down"))
            kv = ly.kv_cache
            if kv.dtype != torch.float32 or kv.dim() != 4 or tuple(kv.shape[1:]) != (hkv, self.block_size, 2 * d) \
                    or not kv.is_contiguous() or not kv.is_cpu:
                raise ValueError(f"layer {li}'s KV cache must be a contiguous float32 CPU tensor "
                                 f"[num_blocks, {hkv}, {self.block_size}, {2 * d}], got {tuple(kv.shape)} {kv.dtype}")
            ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
            arr[li] = _Layer(ptr(ly.ln1), ptr(ly.qkv), ptr(ly.b_qkv), ptr(ly.o), ptr(ly.b_o), ptr(ly.ln2),
                             ptr(ly.gate_up), ptr(ly.b_gate_up), ptr(ly.down), ptr(ly.b_down), ptr(kv))
        if self.lm_head is not None:
            if self.vocab_size < 1 or self.lm_head.shape[1:] != (h, 16):
                raise ValueError(f"lm_head must be a packed [vocab, {h}] weight with vocab_size >= 1")
            _packed(self.lm_head, self.lm_head.shape[0] * 16, h, dt, "lm_head")
        set_(self, "layers", list(self.layers))
        set_(self, "_layer_array", arr)
        set_(self, "_struct", _Model(len(self.layers), h, hq, hkv, d, i, self.block_size, self.cos_sin.shape[1],
                              1 if self.neox else 0, WEIGHT_DTYPES[dt], float(self.eps), float(self.scale),
                              self.cos_sin.shape[0], self.cos_sin.data_ptr(), self.final_norm.data_ptr(),
                              ctypes.cast(arr, ctypes.POINTER(_Layer))))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_blocks(self) -> int:
        """Blocks of the smallest layer cache (the block ids a table may hold are below it)."""
        return min(int(ly.kv_cache.shape[0]) for ly in self.layers)

    def nbytes(self) -> int:
        """Bytes of the packed weights this decoder holds (LM head included)."""
        ts = [t for ly in self.layers for t in (ly.qkv, ly.o, ly.gate_up, ly.down)]
        if self.lm_head is not None:
            ts.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in ts)


def draft_forward(dec: PackedDecoder, x: torch.Tensor, positions, slots, tables: list[torch.Tensor],
                  seq_lens, capture_queries: bool = False):
    """One forward of ``dec`` for ``n`` rows of one token each over their views.

    Args:
        x: ``[n, H]`` float32, the rows' input embeddings.
        positions: ``n`` ints, each row's position (RoPE); below ``cos_sin``'s rows.
        slots: ``n`` ints, each row's KV slot (``block_id * block_size + offset``): its K/V
            are written there in every layer before the layer's attention reads them.
        tables: one int32 ``[n, width]`` block table per layer, or one for all layers: row
            ``r`` lists the physical blocks of row ``r``'s view (its slot's block last).
        seq_lens: ``n`` ints, each view's length in tokens (the row's own token included).
        capture_queries: also return each layer's rotated query.

    Returns:
        ``(prenorm, hidden, queries)``: ``[n, H]`` the residual stream before the final norm
        (the heads' ``h_0``), ``[n, H]`` after it, and ``[num_layers, n, Hq * D]`` (None
        unless ``capture_queries``), all float32.

    Raises:
        ValueError: a shape, dtype or index the kernel would not follow (a block id outside
            every layer's cache, a table too narrow for its view, a slot outside its cache).
        DraftForwardError: the kernel's own refusal (its code's message).
        RuntimeError: the kernel is not loaded.
    """
    lib = _kernel()
    n = int(x.shape[0]) if x.dim() == 2 else 0
    h, bs = dec.hidden, dec.block_size
    if n < 1 or x.shape != (n, h) or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"x must be float32 [n >= 1, {h}] on the CPU, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).contiguous()
    slot = torch.as_tensor(slots, dtype=torch.int64).reshape(-1).contiguous()
    seq = torch.as_tensor(seq_lens, dtype=torch.int32).reshape(-1).contiguous()
    if pos.numel() != n or slot.numel() != n or seq.numel() != n:
        raise ValueError(f"positions, slots and seq_lens need one entry per row ({n})")
    nblocks = dec.num_blocks()
    if int(pos.min()) < 0 or int(pos.max()) >= dec.cos_sin.shape[0]:
        raise ValueError(f"positions must lie in [0, {dec.cos_sin.shape[0]}) (the rotary table)")
    if int(slot.min()) < 0 or int(slot.max()) >= nblocks * bs:
        raise ValueError(f"slots must lie in [0, {nblocks * bs}) (the KV cache)")
    if int(seq.min()) < 1:
        raise ValueError("every view holds at least the row's own token (seq_len >= 1)")
    if len(tables) not in (1, dec.num_layers):
        raise ValueError(f"give one block table for all layers or one per layer ({dec.num_layers}), got {len(tables)}")
    need = int((int(seq.max()) + bs - 1) // bs)
    nblk = (seq.long() + bs - 1) // bs
    keep = []
    for t in tables:
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != n or not t.is_cpu or t.stride(1) != 1:
            raise ValueError(f"a block table must be int32 [{n}, width] with contiguous rows, got "
                             f"{tuple(t.shape)} {t.dtype}")
        if t.shape[1] < need:
            raise ValueError(f"a view of {int(seq.max())} tokens needs {need} blocks, the table is {t.shape[1]} wide")
        used = torch.arange(t.shape[1]).view(1, -1) < nblk.view(-1, 1)
        ids = t[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nblocks):
            raise ValueError(f"a block table holds a block id outside [0, {nblocks})")
        keep.append(t)
    if len(keep) == 1:
        keep = keep * dec.num_layers
    ptrs = (ctypes.c_void_p * dec.num_layers)(*[t.data_ptr() for t in keep])
    strides = torch.tensor([t.stride(0) for t in keep], dtype=torch.int64)
    prenorm = torch.empty(n, h, dtype=torch.float32)
    hidden = torch.empty(n, h, dtype=torch.float32)
    queries = (torch.empty(dec.num_layers, n, dec.num_heads * dec.head_dim, dtype=torch.float32)
               if capture_queries else None)
    rc = lib.tokenswift_draft_forward(
        ctypes.byref(dec._struct), n, x.data_ptr(), pos.data_ptr(), slot.data_ptr(), ptrs, strides.data_ptr(),
        seq.data_ptr(), prenorm.data_ptr(), hidden.data_ptr(),
        queries.data_ptr() if queries is not None else None)
    if rc != 0:
        raise DraftForwardError(f"the native draft forward refused the call (code {rc}): {_error(rc)}")
    return prenorm, hidden, queries


def packed_linear(w: torch.Tensor, n_out: int, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for a packed ``w`` (:func:`pack_weight` of ``W [n_out, K]``):
    ``x`` ``[M, K]`` float32 -> ``[M, n_out]`` float32 (the draft rows' LM head).

    Raises:
        ValueError: ``w`` is not a packed float32/bfloat16 weight of ``n_out`` rows, or ``x``
            does not match its ``K``.
    """
    lib = _kernel()
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(w.dtype)
    if dt is None or w.dim() != 3 or w.shape[2] != 16 or w.shape[0] != -(-n_out // 16) or not w.is_contiguous():
        raise ValueError(f"w must be a packed weight of {n_out} rows (pack_weight), got {tuple(w.shape)} {w.dtype}")
    k = int(w.shape[1])
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    b = _f32(bias, (n_out,), "bias")
    y = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    rc = lib.tokenswift_packed_linear(w.data_ptr(), WEIGHT_DTYPES[dt], b.data_ptr() if b is not None else None,
                                      x.data_ptr(), x.shape[0], k, n_out, y.data_ptr())
    if rc != 0:
        raise DraftForwardError(f"the packed linear refused the call (code {rc}): {_error(rc)}")
    return y


def reference_draft_forward(dec: PackedDecoder, x: torch.Tensor, positions, slots, tables, seq_lens):
    """The definition :func:`draft_forward` implements, in float64 PyTorch on the unpacked
    weights (as rounded in ``dec``): returns ``(prenorm, hidden, queries)`` like it and, like
    it, writes each row's K/V into its slot of every layer's cache. For tests."""
    from vllm_tokenswift.kernels.verify_attention import make_plan, reference_attention

    n, h = x.shape
    hq, hkv, d, inter = dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.intermediate
    bs, rot = dec.block_size, dec.cos_sin.shape[1]
    pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    slot = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
    tables = list(tables) * (dec.num_layers if len(tables) == 1 else 1)

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + dec.eps) * w.double()

    def lin(p, rows, v, b):
        out = v @ unpack_weight(p, rows).double().t()
        return out + b.double() if b is not None else out

    def rope(v, heads):
        v = v.view(n, heads, d).clone()
        cs = dec.cos_sin[pos].double()
        c, s = cs[:, None, : rot // 2], cs[:, None, rot // 2:]
        if dec.neox:
            x1, x2 = v[..., : rot // 2].clone(), v[..., rot // 2: rot].clone()
            v[..., : rot // 2], v[..., rot // 2: rot] = x1 * c - x2 * s, x2 * c + x1 * s
        else:
            x1, x2 = v[..., 0:rot:2].clone(), v[..., 1:rot:2].clone()
            v[..., 0:rot:2], v[..., 1:rot:2] = x1 * c - x2 * s, x2 * c + x1 * s
        return v

    res = x.double()
    qs = []
    plan = make_plan(list(range(n)), [1] * n, list(seq_lens), list(range(n)), num_kv_heads=hkv, gqa=hq // hkv,
                     head_dim=d, block_size=bs, num_threads=1)
    for li, ly in enumerate(dec.layers):
        hcur = norm(res, ly.ln1)
        qkv = lin(ly.qkv, (hq + 2 * hkv) * d, hcur, ly.b_qkv)
        q = rope(qkv[:, : hq * d], hq)
        k = rope(qkv[:, hq * d: (hq + hkv) * d], hkv)
        v = qkv[:, (hq + hkv) * d:].reshape(n, hkv, d)
        kv = ly.kv_cache.view(ly.kv_cache.shape[0], hkv, 2, bs * d)
        for r in range(n):
            b, off = divmod(int(slot[r]), bs)
            kt = kv[b, :, 0].view(hkv, d, bs)
            vv = kv[b, :, 1].view(hkv, bs, d)
            kt[:, :, off] = k[r].float()
            vv[:, off, :] = v[r].float()
        qs.append(q.reshape(n, hq * d).float())
        att = reference_attention(q.float(), ly.kv_cache, tables[li], plan, dec.scale).double()
        res = res + lin(ly.o, h, att.reshape(n, hq * d), ly.b_o)
        hcur = norm(res, ly.ln2)
        gu = lin(ly.gate_up, 2 * inter, hcur, ly.b_gate_up)
        g, u = gu[:, :inter], gu[:, inter:]
        res = res + lin(ly.down, h, torch.nn.functional.silu(g) * u, ly.b_down)
    return res.float(), norm(res, dec.final_norm).float(), torch.stack(qs)
