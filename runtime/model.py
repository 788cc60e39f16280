"""One decoder for Qwen3 and Llama, driven by ModelConfig. The file only assembles layers; the math is in
the ops backend (``runtime/ops.py`` or the Triton kernels) and weight fusion is data (``PACKED_MODULES``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from kernellab.runtime.attention import AttentionMetadata, LayerKV, paged_attention, triton_prefill
from kernellab.runtime.config import ModelConfig
from kernellab.runtime.dispatch import Ops

# Decode steps of at most this many rows take the fused QK-norm + RoPE + KV-write attention (``decode_attention``).
# The H200 gate at fb84893 (fused at every batch) measured batch-1 ITL 8.4 % [6.2, 10.6] faster with it and the
# 64-row decode step's throughput 3.1 % [2.2, 3.9] slower, so larger batches keep the two kernels. 16 lies between
# the two measured sizes; where the two forms cross is not measured yet (latency_anatomy.py --decode-ab).
FUSED_DECODE_MAX_ROWS = 16
# Batch-1 decode with ``l2_prefetch`` enabled: after a layer's QKV GEMV, its output projection's and MLP's weights
# are fetched into L2 while the attention runs, and with this also the next layer's QKV weights (31 MB in all at
# Qwen3-0.6B, within the H200's 50 MB L2). ``PREFETCH_LINES``: line prefetches instead of bulk ones;
# ``PREFETCH_SIDE_STREAM``: launched on a second stream that forks after the QKV GEMV and joins at the end of the
# forward, so no kernel of the layer waits for the prefetch to finish (in the PDL chain the attention would).
PREFETCH_NEXT_QKV = True
PREFETCH_LINES = False
PREFETCH_SIDE_STREAM = True
# Steps of at least this many rows run the MLP's gate/up projection with the SwiGLU in its epilogue
# (``gate_up_swiglu``, where enabled): on the H100 1.18-1.19× cuBLAS + ``silu_and_mul`` at 2,048 and 4,096 rows,
# 0.96× at 512 (``kernels/gemm.py: gate_up_swiglu``). Read when a step runs, so a CUDA graph keeps the form its
# bucket was captured with.
GATE_UP_SWIGLU_MIN_ROWS = 1024
# Qwen3 steps of at least this many rows run the QKV projection with the QK-norm, RoPE and KV write in its
# epilogue (``qkv_proj_norm_rope_store_kv``, where enabled, with the Triton prefill attention reading q, k and v as
# views of the projection's rows): one kernel instead of cuBLAS's GEMM and ``qk_norm_rope_store_kv``.
QKV_ROPE_MIN_ROWS = 1024
# A step of fresh prompt rows only whose logits are taken at a few rows (a prompt's last token): its last layer
# computes every row's K/V (the cache needs them) but attention, output projection and MLP for those rows alone
# (``CausalLM._layers``): at 2,048 tokens, one attention row instead of 2,048 and GEMVs instead of GEMMs. Read when
# a step runs, so a CUDA graph keeps the form it was captured with. Off: TTFT at 2,048 tokens 5.084 ms with it
# against 5.015 without (H100, 06e7fe6, 6 interleaved rounds, ``engine_h200_dev/knob_ab_prune_last_layer_h100_
# 06e7fe6.json``): the one-row attention here is ~20 small kernels in torch, which cost what the skipped GEMMs saved.
PRUNE_LAST_LAYER = False
# Logits of several rows (decode steps, several prompts' last tokens) stay in the model's dtype: widening them was
# a pass of its own in every decode step (256 rows × 151,936: ~120 µs an H100 step, `kv_dtype_profile_h100_
# c7665a7.json`'s direct_copy_kernel), and a greedy argmax of the stored values is that of the widened ones. True
# restores the fp32 copy (the form before, for ``knob_ab.py``). Read when a step runs, so a CUDA graph keeps the form
# its bucket was captured with. An int N widens the logits of up to N rows (one row always is: the GEMV stores fp32).
WIDEN_LOGITS: bool | int = False

if TYPE_CHECKING:
    from kernellab.runtime.quant import Int4Pair, Int4Weight

# HF checkpoint module → (our fused module, shard index). Shard sizes come from the config.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight: torch.Tensor = _param(out_features, in_features)  # or a tied embedding's Parameter
        # an int4 form (runtime/quant.py) beside the dense weight, for steps with few rows
        self.int4: Int4Weight | Int4Pair | None = None


class Norm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = _param(size)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = Norm(cfg.head_dim)
            self.k_norm = Norm(cfg.head_dim)
        self.shard_sizes = {"qkv_proj": (cfg.q_size, cfg.kv_size, cfg.kv_size)}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.shard_sizes = {"gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = Norm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = Norm(cfg.hidden_size)
        self.mlp = MLP(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size)


class CausalLM(nn.Module):
    """``forward(input_ids (T,), meta, kv_caches) → hidden (T, H)``; ``compute_logits(hidden) → (N, V)`` (the LM
    head's values in the model's dtype; one row stored as fp32)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, cos_sin_cache: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.model = Backbone(cfg)
        self.decoder_layers: list[DecoderLayer] = list(cast("Iterable[DecoderLayer]", self.model.layers))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.scale = cfg.head_dim**-0.5
        self.int4_max_rows = 0
        # batch-1 L2 prefetch (``_prefetch``): only inside ``forward`` (a piecewise graph's pieces never fork)
        self._prefetching = False
        self._side_stream: torch.cuda.Stream | None = None
        self._side_pending = False
        # the forward in progress is a whole-step CUDA graph's (its capture, the warm-ups before it, a CPU's eager
        # stand-in): attention.triton_prefill (``graphed_attention``)
        self._graphed = False

    def _linear(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        if lin.int4 is not None and x.shape[0] <= self.int4_max_rows:
            return lin.int4.mm(x)
        return self.ops.linear(x, lin.weight)

    def _add_norm_linear(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: Norm, lin: Linear
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lin(norm(hidden + residual)), hidden + residual)``, or with no residual (a model's first layer)
        ``(lin(norm(hidden)), hidden)``; one row (batch-1 decode): the norm inside the projection's GEMV, where that
        op is enabled."""
        if self._norm_in_gemv(hidden, lin):
            return self.ops.add_rms_norm_linear(hidden, residual, norm.weight, self.cfg.rms_norm_eps, lin.weight)
        x, residual = self._add_norm(hidden, residual, norm)
        return self._linear(x, lin), residual

    def _add_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: Norm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(hidden + residual), hidden + residual)``, or with no residual (a model's first layer)
        ``(norm(hidden), hidden)``."""
        eps = self.cfg.rms_norm_eps
        if residual is None:
            return self.ops.rms_norm(hidden, norm.weight, eps), hidden
        return self.ops.add_rms_norm(hidden, residual, norm.weight, eps)

    def _norm_in_gemv(self, hidden: torch.Tensor, lin: Linear) -> bool:
        """Whether a norm feeding ``lin`` runs inside its GEMV: one row (batch-1 decode), the op enabled, dense."""
        return hidden.shape[0] == 1 and "add_rms_norm_linear" in self.ops.enabled and lin.int4 is None

    def _mlp(self, gate_up: torch.Tensor, mlp: MLP) -> torch.Tensor:
        """The MLP from its gate/up projection's output."""
        down = mlp.down_proj
        # one row (batch-1 decode): the SwiGLU inside the down projection's GEMV, where that op is enabled
        if gate_up.shape[0] == 1 and "silu_and_mul_linear" in self.ops.enabled and down.int4 is None:
            return self.ops.silu_and_mul_linear(gate_up, down.weight)
        return self._linear(self.ops.silu_and_mul(gate_up), down)

    # The forward in the pieces a piecewise CUDA graph captures (runtime/graphs.py ``PiecewiseGraphs``): everything
    # between two attention calls is row-wise and depends on the step's token count only, so it replays from a
    # graph captured per token bucket, while attention, which depends on the step's mix of decode rows, fresh
    # prompts and chunks after a cached context, runs eagerly between the pieces.
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _qkv(
        self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index``'s (residual add and) input norm and QKV projection: ``(q, k, v, residual)``, heads
        unflattened, views of the one fused projection row."""
        layer = self.decoder_layers[index]
        qkv, residual = self._add_norm_linear(hidden, residual, layer.input_layernorm, layer.self_attn.qkv_proj)
        if qkv.shape[0] == 1 and self._prefetching and "l2_prefetch" in self.ops.enabled:
            self._prefetch(qkv, self._weights_after_qkv(index))
        return (*self._heads(qkv), residual)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the fused projection's rows, heads unflattened (views)."""
        cfg = self.cfg
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
        q, k, v = (x.view(-1, h, cfg.head_dim) for x, h in zip((q, k, v), heads, strict=True))
        return q, k, v

    def _prefetch(self, after: torch.Tensor, weights: list[torch.Tensor]) -> None:
        """``l2_prefetch`` of ``weights`` once ``after`` (the QKV projection) is computed: in the stream's PDL chain,
        or on the side stream (``PREFETCH_SIDE_STREAM``, CUDA only), which ``forward`` joins before it returns."""
        if not weights:
            return
        if PREFETCH_SIDE_STREAM and after.is_cuda:
            main = torch.cuda.current_stream(after.device)
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(after.device)
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                self.ops.l2_prefetch(*weights, lines=PREFETCH_LINES, pdl=False)
            self._side_pending = True
        else:
            self.ops.l2_prefetch(*weights, lines=PREFETCH_LINES)

    def _weights_after_qkv(self, index: int) -> list[torch.Tensor]:
        """The dense weights layer ``index`` reads after its QKV projection (output projection, gate/up, down),
        then the next layer's QKV (``PREFETCH_NEXT_QKV``): what a batch-1 step prefetches into L2 while the
        attention runs. A layer with int4 weights reads those instead and prefetches nothing."""
        layer = self.decoder_layers[index]
        linears = [layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        if PREFETCH_NEXT_QKV and index + 1 < len(self.decoder_layers):
            linears.append(self.decoder_layers[index + 1].self_attn.qkv_proj)
        if any(lin.int4 is not None and self.int4_max_rows >= 1 for lin in linears):
            return []
        return [lin.weight for lin in linears]

    def pre_attention(
        self,
        index: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv: LayerKV,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``index`` up to attention: (residual add and) norm, the QKV projection, RoPE (Qwen3: with its QK
        norm) and the KV-cache write at ``meta.slot_mapping``. Returns ``(q, k, v, residual)``, heads unflattened."""
        cfg, ops = self.cfg, self.ops
        layer = self.decoder_layers[index]
        attn = layer.self_attn
        if self._qkv_epilogue(hidden, kv, attn.qkv_proj):
            x, residual = self._add_norm(hidden, residual, layer.input_layernorm)
            qkv = ops.qkv_proj_norm_rope_store_kv(
                x, attn.qkv_proj.weight, meta.positions, attn.q_norm.weight, attn.k_norm.weight, cfg.rms_norm_eps,
                self.cos_sin_cache, kv.k, kv.v, meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads,
            )  # fmt: skip
            return (*self._heads(qkv), residual)
        q, k, v, residual = self._qkv(index, hidden, residual)
        scales = {"k_scales": kv.k_scales, "v_scales": kv.v_scales}
        if cfg.qk_norm:
            # Steps that prefill on a GPU get v dense from the same kernel: the prefill attention (cuDNN's) needs it
            # so, and a separate copy cost a launch and 6 µs a layer at 2,048 tokens on the H200. The Triton prefill
            # attention (varlen_causal_attention) reads the strided view of the QKV row through its descriptors, so
            # with it the copy (4 MB a layer at 2,048 tokens) is skipped. Decode reads the cache.
            dense_v = v.is_cuda and meta.num_decode_tokens < v.shape[0] and not triton_prefill(ops, self._graphed)
            v_out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dense_v else None
            q, k = ops.qk_norm_rope_store_kv(
                meta.positions,
                q,
                k,
                v,
                attn.q_norm.weight,
                attn.k_norm.weight,
                cfg.rms_norm_eps,
                self.cos_sin_cache,
                kv.k,
                kv.v,
                meta.slot_mapping,
                v_out=v_out,
                **scales,
            )
            v = v if v_out is None else v_out
        else:
            q, k = ops.rotary_embedding(meta.positions, q, k, self.cos_sin_cache)
            ops.store_kv(k, v, kv.k, kv.v, meta.slot_mapping, **scales)
        return q, k, v, residual

    def _qkv_epilogue(self, hidden: torch.Tensor, kv: LayerKV, qkv_proj: Linear) -> bool:
        """Whether this step's QKV projection takes Qwen3's QK-norm, RoPE and KV write in its epilogue: enough rows
        (``QKV_ROPE_MIN_ROWS``; a piecewise graph's bucket decides it at capture), the op enabled, a cache in the
        model's dtype, dense weights, and the Triton prefill attention, which reads q, k and v where the projection
        left them (the other attention paths read them as views too, as v already is with it)."""
        ops = self.ops
        return (
            self.cfg.qk_norm
            and hidden.shape[0] >= QKV_ROPE_MIN_ROWS
            and "qkv_proj_norm_rope_store_kv" in ops.enabled
            and triton_prefill(ops, self._graphed)
            and kv.k_scales is None
            and qkv_proj.int4 is None
        )

    def _fused_decode(self, meta: AttentionMetadata, rows: int, kv: LayerKV) -> bool:
        """Whether this step's attention takes the QK-norm, RoPE and KV write inside (decode rows only, Qwen3, the
        fused kernel enabled, a cache in the model's dtype)."""
        return (
            self.cfg.qk_norm
            and "paged_decode_attention_qk_norm_rope" in self.ops.enabled
            and meta.num_decode_tokens == rows > 0
            and rows <= FUSED_DECODE_MAX_ROWS
            and kv.k_scales is None
        )

    def decode_attention(
        self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata, kv: LayerKV
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's layer ``index`` through its output projection in three launches (the QKV projection
        with its norm, attention with Qwen3's QK-norm, RoPE and the KV write inside, the output projection). One
        row with ``decode_attention_o_proj`` enabled: that op's attention and projection, which merges a few-slice
        attention's slices as it loads them. Returns ``(o_proj output, residual)``."""
        cfg = self.cfg
        attn = self.decoder_layers[index].self_attn
        q, k, v, residual = self._qkv(index, hidden, residual)
        args = (
            q,
            k,
            v,
            attn.q_norm.weight,
            attn.k_norm.weight,
            cfg.rms_norm_eps,
            self.cos_sin_cache,
            kv.k,
            kv.v,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
        )
        o_proj = attn.o_proj
        if q.shape[0] == 1 and "decode_attention_o_proj" in self.ops.enabled and o_proj.int4 is None:
            return self.ops.decode_attention_o_proj(*args, o_proj.weight), residual
        o = self.ops.paged_decode_attention_qk_norm_rope(*args)
        return self._linear(o.reshape(-1, cfg.q_size), o_proj), residual

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, kv: LayerKV
    ) -> torch.Tensor:
        """Attention of the step's rows (their K/V already in the cache) → ``(T, q_size)``."""
        o = paged_attention(
            self.ops, q, k, v, kv.k, kv.v, meta, self.scale, k_scales=kv.k_scales, v_scales=kv.v_scales,
            graphed=self._graphed,
        )  # fmt: skip
        return o.reshape(-1, self.cfg.q_size)

    @contextlib.contextmanager
    def graphed_attention(self):
        """Within: the forwards run are a whole-step CUDA graph's (``GraphRunner._capture``'s warm-ups and capture,
        a CPU's ``EagerReplay``), whose attention is captured with the rest, so the Triton prefill attention may
        run there (``attention.triton_prefill``); a piecewise graph's attention runs eagerly, outside."""
        before, self._graphed = self._graphed, True
        try:
            yield
        finally:
            self._graphed = before

    def _attend_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        meta: AttentionMetadata,
        kv: LayerKV,
    ) -> torch.Tensor:
        """Attention of the step's ``rows`` alone → ``(R, q_size)``, each row a fresh prompt's (no cached context,
        no decode rows in the step): its keys are this step's rows from its prompt's first (``row - position``) to
        itself. One prompt: its last row as a decode row over the cache the layer just wrote (the prompt's blocks
        read off its slots, whose first of each block is the block's start; padding slots, -1, lie past its
        length). Several: in fp32 (scores, softmax and ``P·V``), rounded to q's dtype at the end, as the attention
        kernels keep their scores. Every index stays on the device, so a CUDA graph captures it with its rows as
        inputs."""
        cfg = self.cfg
        cu = meta.prefill_cu_seqlens_host
        if rows.shape[0] == 1 and meta.prefill_num_fresh == 1 and cu is not None and len(cu) == 2:
            bs = kv.k.shape[1]
            # padding slots (-1) → block 0: past the prompt's length, never read (at a graph's capture every slot
            # is -1 and the row's context one token: a block -1 there was an illegal address on the H100)
            tables = (
                torch.div(meta.slot_mapping[::bs], bs, rounding_mode="floor").clamp_(min=0).to(torch.int32)[None, :]
            )
            o = self.ops.paged_decode_attention(
                q.index_select(0, rows), kv.k, kv.v, tables, rows + 1, self.scale,
                k_scales=kv.k_scales, v_scales=kv.v_scales,
            )  # fmt: skip
            return o.reshape(1, cfg.q_size)
        positions = meta.positions
        hk, d = cfg.num_kv_heads, cfg.head_dim
        qr = q.index_select(0, rows).float().view(rows.shape[0], hk, -1, d)  # (R, Hk, G, D)
        s = torch.einsum("rkgd,tkd->rkgt", qr, k.float()) * self.scale  # (R, Hk, G, T)
        t = torch.arange(k.shape[0], device=k.device)
        first = rows - positions.index_select(0, rows)
        keep = (t[None, :] <= rows[:, None]) & (t[None, :] >= first[:, None])  # (R, T)
        p = torch.softmax(s.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1)
        o = torch.einsum("rkgt,tkd->rkgd", p, v.float())
        return o.reshape(rows.shape[0], cfg.q_size).to(q.dtype)

    def o_proj_weight(self, index: int) -> torch.Tensor:
        return self.decoder_layers[index].self_attn.o_proj.weight

    def post_attention(
        self, index: int, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` after its output projection (``hidden``): residual add, norm and the MLP. Returns
        ``(mlp output, residual)``."""
        layer = self.decoder_layers[index]
        mlp = layer.mlp
        if (
            hidden.shape[0] >= GATE_UP_SWIGLU_MIN_ROWS
            and "gate_up_swiglu" in self.ops.enabled
            and mlp.gate_up_proj.int4 is None
        ):  # a prefill step's many rows: the SwiGLU in the gate/up GEMM's epilogue
            x, residual = self._add_norm(hidden, residual, layer.post_attention_layernorm)
            return self._linear(self.ops.gate_up_swiglu(x, mlp.gate_up_proj.weight), mlp.down_proj), residual
        gate_up, residual = self._add_norm_linear(hidden, residual, layer.post_attention_layernorm, mlp.gate_up_proj)
        return self._mlp(gate_up, mlp), residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(hidden, residual, self.model.norm.weight, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKV],
        collect: list | None = None,
    ) -> torch.Tensor:
        """The final hidden states (normed). ``collect``, when given, receives the residual stream after each layer
        (numerics checks)."""
        return self.final_norm(*self._layers(input_ids, meta, kv_caches, collect))

    @torch.inference_mode()
    def logits(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[LayerKV], rows: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits (``compute_logits``) of the step's ``rows`` (``meta.logits_indices``; None: every row, as a
        decode step needs): the final norm runs on those rows only (a prefill's last token, not its 2,048). The
        values of ``compute_logits(forward(…)[rows])``."""
        prune = rows is not None and PRUNE_LAST_LAYER and meta.num_decode_tokens == 0 and meta.prefill_gather is None
        hidden, residual = self._layers(input_ids, meta, kv_caches, rows=rows if prune else None)
        if rows is not None and not prune:
            hidden, residual = hidden[rows], residual[rows]
        return self.compute_logits(self.final_norm(hidden, residual))

    def _layers(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKV],
        collect: list | None = None,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer: the last one's output and the residual stream, before the final norm. ``rows``
        (a step of fresh prompt rows only, whose logits are needed at those rows): the last layer writes every
        row's K/V, then attends, projects and runs its MLP for those rows alone (``_attend_rows``), and returns
        theirs."""
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        fused = self._fused_decode(meta, input_ids.shape[0], kv_caches[0])
        self._prefetching = input_ids.shape[0] == 1
        last = len(kv_caches) - 1
        try:
            for i, kv in enumerate(kv_caches):
                if fused:
                    hidden, residual = self.decode_attention(i, hidden, residual, meta, kv)
                else:
                    q, k, v, residual = self.pre_attention(i, hidden, residual, meta, kv)
                    if i == last and rows is not None and collect is None:
                        o = self._attend_rows(q, k, v, rows, meta, kv)
                        residual = residual.index_select(0, rows)
                    else:
                        o = self.attend(q, k, v, meta, kv)
                    hidden = self._linear(o, self.decoder_layers[i].self_attn.o_proj)
                hidden, residual = self.post_attention(i, hidden, residual)
                if collect is not None:
                    collect.append(hidden + residual)
        finally:
            self._prefetching = False
            if self._side_pending and self._side_stream is not None:  # join the prefetches' stream
                torch.cuda.current_stream(self._side_stream.device).wait_stream(self._side_stream)
                self._side_pending = False
        assert residual is not None  # a model has at least one layer
        return hidden, residual

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states: the LM head's output rounded to the model's dtype. One row (batch-1
        decode, a prompt's last token) is stored as fp32 by the GEMV itself, at no cost; more rows stay in the
        model's dtype, since widening them is a pass of its own (256 decode rows × 151,936: 233 MB moved, ~120 µs
        an H100 step) that a greedy argmax does not need: widening is exact and keeps the order, so the argmax of
        the stored values is the argmax of the fp32 ones. Whoever computes with logits widens them (the sampler's
        temperature, penalties, biases and masks; log-probabilities)."""
        if self.lm_head.int4 is not None and hidden.shape[0] <= self.int4_max_rows:
            return self.lm_head.int4.mm(hidden).float()
        rows, widen = hidden.shape[0], WIDEN_LOGITS
        if hidden.dtype == torch.float32 or not (rows == 1 or widen is True or (type(widen) is int and rows <= widen)):
            return self.ops.linear(hidden, self.lm_head.weight)
        out = torch.empty((hidden.shape[0], self.cfg.vocab_size), dtype=torch.float32, device=hidden.device)
        return self.ops.linear(hidden, self.lm_head.weight, out=out)

    @torch.inference_mode()
    def attach_int4(self, int4_weights, dtype: torch.dtype, max_rows: int) -> int:
        """Give every linear whose (fused) weight is all Q4_1, or all Q8_0, an int4 form (``runtime/quant.py``);
        returns how many got one. The dense weights stay: steps with more than ``max_rows`` rows use them."""
        from kernellab.runtime.quant import Int4Pair, Int4Weight, fuse_rows

        shards: dict[str, dict[int, tuple]] = {}
        for name, parts in int4_weights:
            target, shard = name, 0
            for short, (packed, idx) in PACKED_MODULES.items():
                if f".{short}." in name:
                    target, shard = name.replace(f".{short}.", f".{packed}."), idx
                    break
            target = target.removesuffix(".weight")
            if target == "model.embed_tokens":
                if not self.cfg.tie_word_embeddings:
                    continue
                target = "lm_head"  # the tied LM head reads the embedding's weight
            shards.setdefault(target, {})[shard] = parts
        count = 0
        for module_name, got in shards.items():
            lin = self.get_submodule(module_name)
            assert isinstance(lin, Linear)  # the fused projections and lm_head
            parts = [got[i] for i in sorted(got)]
            kinds = {p[0] for p in parts}
            if (
                sorted(got) != list(range(len(got)))
                or len(kinds) != 1
                or sum(p[1].shape[0] for p in parts) != lin.weight.shape[0]
                or lin.weight.shape[0] % 16
            ):
                continue  # a shard missing or of another type, or rows the int4pack layout cannot hold: dense
            arrays = fuse_rows([p[1:] for p in parts])
            lin.int4 = (Int4Weight.from_q4_1(*arrays) if kinds == {"q4_1"} else Int4Pair.from_q8_0(*arrays)).to(dtype)
            count += 1
        self.int4_max_rows = max_rows
        return count

    @torch.inference_mode()
    def load_weights(self, weights) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters; returns the names of parameters loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            target, offset, size = name, 0, None
            for short, (packed, shard) in PACKED_MODULES.items():
                if f".{short}." in name:
                    target = name.replace(f".{short}.", f".{packed}.")
                    owner = self.get_submodule(target.rsplit(".", 2)[0])
                    assert isinstance(owner, Attention | MLP)  # the modules PACKED_MODULES fuses into
                    sizes = owner.shard_sizes[packed]
                    offset, size = sum(sizes[:shard]), sizes[shard]
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {self.cfg.architecture} model")
            param = params[target]
            dest = param.data if size is None else param.data[offset : offset + size]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(target)
        missing = {
            n for n in params if n not in loaded and not (n == "lm_head.weight" and self.cfg.tie_word_embeddings)
        }
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        return loaded
