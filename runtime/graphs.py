"""CUDA graphs: decode steps by batch bucket, single-prompt prefill by length bucket, steps of several fresh
prompts by (tokens, prompts) bucket, and one chunk that continues a cached context (a chat turn after a system
prompt the prefix cache holds) by (chunk, context) bucket.

A graph replays a fixed sequence of kernels on fixed addresses, so each step copies its inputs into static
buffers (one host→device copy for the int64 inputs, one for the block table) and replays the captured
graph of the smallest bucket that fits; padding rows get slot -1 (no KV write) and context length 1 (a
harmless read of block 0). The captured region ends with the LM head, so a replay yields logits.

Only ops without host syncs can be captured: the dispatcher's ``graph_safe`` says whether the enabled
kernels allow it (the Triton KV write and paged decode attention).

Several fresh prompts in one step (a burst's first step, a worker's pure-prefill steps) replay the ("fresh",
tokens, prompts) graph of the smallest bucket pair that fits: the prompts packed as the step has them, then
padding rows (slot -1, outside every sequence); ``cu_seqlens`` in a static buffer, padded with zero-length
sequences at the end; FlashAttention's varlen call takes the bucket's token count as ``max_seqlen`` (an upper
bound: it sizes the grid, programs past a sequence's end exit). Through the piecewise graphs such a step
launched 28 graph pieces, 28 attention calls and 28 output projections from Python, which the serving worker's
other threads and the gateway processes stretch: on the H200 an 8 × 512 first step took 12-18 ms in the worker
against ~10.5 ms in the engine alone (docs/deploy.md).

A chunk after a cached context otherwise runs eagerly: every Triton launch then costs ~85 µs of Python on the
H200's host (measured), ~25 ms for Qwen3-0.6B's 28 layers against ~2 ms of GPU work. Its graph gathers the
context from the cache (``attention.ContextGather`` in static buffers: the context's slots padded with slot 0,
``cu_k = [0, context]``) and runs FlashAttention's varlen call with the bucket's bounds as ``max_seqlen``;
padding query rows lie past ``cu_q = [0, n]``, so attention leaves them out, their KV writes are skipped
(slot -1) and their positions are 0.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from kernellab.runtime.attention import AttentionMetadata, ContextGather
from kernellab.runtime.request.block_manager import slot_of

log = logging.getLogger(__name__)

# The batch-1 decode graph in a memory pool of its own, so its buffers' addresses do not depend on the buckets captured
# before it into the shared pool (how many, their logits' dtype). On an H100 the same bucket-1 graph, same kernels and
# inputs, replayed at 0.802 or 0.821 ms a token at context 128 depending only on that layout; in a pool of its own,
# 0.803 against 0.821 (ITL 0.820 against 0.835) in the latency engine's 4 buckets, ITL 0.805 against 0.821 in an
# engine of 256 rows' buckets, the same at context 2,048 and at 256 rows (``engine_h200_dev/knob_ab_b1_own_pool_*``,
# interleaved rounds, the same tokens). Which buffer's placement costs the 19 µs is not traced.
DECODE_B1_OWN_POOL = True
DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
PREFILL_BUCKETS = (128, 256, 512, 1024, 2048, 4096)
CHUNK_BUCKETS = (32, 128, 512)  # a chunk after a cached context: its new tokens …
CONTEXT_BUCKETS = (1024, 2048, 4096, 8192)  # … and the whole context it attends (cached + new)
FRESH_TOKEN_BUCKETS = (512, 1024, 2048, 4096)  # several fresh prompts in one step: their tokens …
FRESH_SEQ_BUCKETS = (2, 4, 8, 16)  # … and how many (larger steps are GPU-bound: the piecewise graphs keep up)


class DecodeWindow:
    """One of the two alternating sets of host buffers a decode window is launched from and read into, and the
    event recorded once its tokens are on the host."""

    def __init__(self, steps: int, rows: int, width: int, cuda: bool):
        self.host_tables = torch.zeros((rows, width), dtype=torch.int32, pin_memory=cuda)
        self.host_plan = torch.zeros((steps, 3, rows), dtype=torch.int64, pin_memory=cuda)
        self.host_ids = torch.zeros(rows, dtype=torch.int64, pin_memory=cuda)
        self.host_rows = torch.zeros(rows, dtype=torch.int64, pin_memory=cuda)
        self.tokens = torch.zeros((steps, rows), dtype=torch.int64, pin_memory=cuda)
        self.done = torch.cuda.Event() if cuda else None
        self.n = self.bs = self.steps = 0
        self.allowed: list[int] = []
        self.pending = False  # launched and not waited for

    def grid(self) -> torch.Tensor:
        """The window's tokens as (steps, bucket rows), laid out at the start of ``tokens``: one contiguous copy."""
        return self.tokens.view(-1)[: self.steps * self.bs].view(self.steps, self.bs)


class EagerReplay:
    """A decode bucket's forward run eagerly over the graph runner's static buffers, where no CUDA graph can be
    captured (a CPU): decode windows and asynchronous scheduling then take the GPU's path, which the CPU tests
    check against plain steps."""

    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor):
        self.forward, self.out = forward, out

    def replay(self) -> None:
        self.out.copy_(self.forward())


class GraphRunner:
    def __init__(
        self,
        model,
        kv_caches,
        device,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        prefill_buckets: tuple[int, ...] = PREFILL_BUCKETS,
        chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS,
        context_buckets: tuple[int, ...] = CONTEXT_BUCKETS,
        fresh_token_buckets: tuple[int, ...] = FRESH_TOKEN_BUCKETS,
        fresh_seq_buckets: tuple[int, ...] = FRESH_SEQ_BUCKETS,
        max_num_batched_tokens: int | None = None,
    ):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        cuda = torch.device(device).type == "cuda"
        # around the wait for a decode window's tokens (runtime/host_gate.py)
        self.device_wait: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        self.block_size = block_size
        self.width = -(-max_model_len // block_size)
        self.decode_buckets = tuple(b for b in DECODE_BUCKETS if b <= max_num_seqs) or (1,)
        if max_num_seqs > self.decode_buckets[-1]:
            self.decode_buckets += (max_num_seqs,)
        self.prefill_buckets = tuple(b for b in prefill_buckets if b < max_model_len)
        # context buckets up to the first that holds max_model_len; a chunk is shorter than its context
        self.context_buckets = tuple(
            c for i, c in enumerate(context_buckets) if i == 0 or context_buckets[i - 1] < max_model_len
        )
        self.chunk_buckets = tuple(b for b in chunk_buckets if b < max_model_len)
        # up to the first bucket that holds a whole step's budget: no step needs a larger one
        budget = max_num_batched_tokens or max(fresh_token_buckets, default=0)
        self.fresh_token_buckets = tuple(
            b for i, b in enumerate(fresh_token_buckets) if i == 0 or fresh_token_buckets[i - 1] < budget
        )
        self.fresh_seq_buckets = tuple(b for b in fresh_seq_buckets if b <= max_num_seqs)
        n = max(
            self.decode_buckets[-1],
            max(self.prefill_buckets, default=1),
            max(self.chunk_buckets, default=1),
            max(self.fresh_token_buckets, default=1),
        )
        # int64 inputs: rows = input_ids, positions, slot_mapping, context_lens (one copy for all four; the decode
        # attention reads the context lengths as int64 where they are, no int32 copy a step).
        self.host = torch.zeros((4, n), dtype=torch.int64, pin_memory=cuda)
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.inputs[3].fill_(1)
        # A fresh prompt's graph reads its four rows from a (4, bucket) block of its own (``_prefill_rows``), so they
        # cross from the host in one contiguous copy: copying the (4, bucket) slice of ``inputs`` took torch a
        # pageable temporary and a device kernel, or four copies, each CUDA call 30 µs of host time on the lent
        # H100 (``latency_anatomy.py``'s timeline at 6b1d491 and 06e7fe6), all before the device could start. The
        # blocks do not overlap (258 KB for buckets up to 4,096): a graph replayed on its last inputs reads its own
        # rows, never another bucket's slots (-1) as token ids (an out-of-range embedding index on the H100, be5976f).
        self.prefill_host = torch.zeros(4 * max(self.prefill_buckets, default=1), dtype=torch.int64, pin_memory=cuda)
        self.prefill_inputs, self._prefill_at = bucket_blocks(self.prefill_buckets, device)
        self.host_tables = torch.zeros((self.decode_buckets[-1], self.width), dtype=torch.int32, pin_memory=cuda)
        self.tables = torch.zeros((self.decode_buckets[-1], self.width), dtype=torch.int32, device=device)
        # Multi-step decode: per step k, rows (positions, slots, context_lens) planned on the host up front, in
        # one of two alternating sets of host buffers (asynchronous scheduling launches a window while the one
        # before it may still be copying from its set).
        self.max_steps = 16
        rows = self.decode_buckets[-1]
        self.windows = [DecodeWindow(self.max_steps, rows, self.width, cuda) for _ in range(2)]
        self._next_window = 0
        self.carried_windows = 0  # windows launched before the last one was read (the gate checks they happen)
        self.plan = torch.zeros((self.max_steps, 3, rows), dtype=torch.int64, device=device)
        self.step_tokens = torch.zeros((self.max_steps, rows), dtype=torch.int64, device=device)
        # A chunk after a cached context: its context's cache slots, and (cu_q, cu_k) of the one chunk.
        c = max(self.context_buckets, default=1)
        self.host_ctx = torch.zeros(c + 4, dtype=torch.int64, pin_memory=cuda)
        self.ctx = torch.zeros(c + 4, dtype=torch.int64, device=device)
        self.ctx_cu = torch.zeros(4, dtype=torch.int32, device=device)
        # Several fresh prompts: cu_seqlens (int32, as FlashAttention takes them) and the rows whose logits are
        # needed, filled through one int64 host → device copy.
        sf = max(self.fresh_seq_buckets, default=1)
        self.host_fresh = torch.zeros(2 * sf + 1, dtype=torch.int64, pin_memory=cuda)
        self.fresh_inputs = torch.zeros(2 * sf + 1, dtype=torch.int64, device=device)
        self.fresh_cu = torch.zeros(sf + 1, dtype=torch.int32, device=device)
        self.fresh_rows = torch.zeros(sf, dtype=torch.int64, device=device)
        self.fresh_replays = 0  # several-fresh-prompt replays so far (the gate checks they happen)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple, torch.Tensor] = {}
        # A graph records addresses only: every tensor it reads (the metadata's too) must outlive it.
        self.metas: dict[tuple, AttentionMetadata] = {}
        self.pool: torch.cuda._POOL_HANDLE | None = None  # the memory pool all graphs share
        self.chunk_replays = 0  # chunk-after-context replays so far (the gate checks they happen)

    # ------------------------------------------------------------------ capture
    def _decode_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.inputs[1, :bs],
            slot_mapping=self.inputs[2, :bs],
            num_decode_tokens=bs,
            decode_block_tables=self.tables[:bs],
            decode_context_lens=self.inputs[3, :bs],
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
            logits_indices=torch.arange(bs, device=self.device),
            max_decode_context=self.width * self.block_size,
        )

    def _prefill_rows(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s (ids, positions, slots, logits row) block: ``(4, b)``, contiguous, its own."""
        return bucket_rows(self.prefill_inputs, self._prefill_at, b)

    def _prefill_meta(self, n: int) -> AttentionMetadata:
        return prefill_metadata(self._prefill_rows(n), n)

    def _chunk_meta(self, n: int, c: int) -> AttentionMetadata:
        return chunk_metadata(self.inputs, self.ctx, self.ctx_cu, n, c)

    def _fresh_meta(self, t: int, s: int) -> AttentionMetadata:
        return fresh_metadata(self.inputs, self.fresh_cu, self.fresh_rows, t, s)

    def _capture(self, key: tuple, meta: AttentionMetadata) -> None:
        n = key[1]
        ids = self._prefill_rows(n)[0] if key[0] == "prefill" else self.inputs[0, :n]
        rows = None if key[0] == "decode" else meta.logits_indices  # a decode step's logits are all its rows'
        with self.model.graphed_attention():  # the step's attention is captured with it (attention.triton_prefill)
            for _ in range(2):  # warm up: Triton compilation and autotuning happen outside the capture
                self.model.logits(ids, meta, self.kv_caches, rows)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            own = key == ("decode", 1) and DECODE_B1_OWN_POOL
            with torch.cuda.graph(graph, pool=None if own else self.pool):
                self.logits[key] = self.model.logits(ids, meta, self.kv_caches, rows)
        if not own:
            self.pool = graph.pool()
        self.graphs[key] = graph
        self.metas[key] = meta

    @torch.inference_mode()
    def eager(self, prefill: bool = False) -> None:
        """No capture (a CPU): decode buckets only, each an ``EagerReplay`` of the forward ``_capture`` would
        capture; with ``prefill`` the fresh prompts' buckets too (over their own input blocks, as captured); the
        other kinds of graph are left out (their steps run as without graphs)."""
        self.inputs[2].fill_(-1)
        self.chunk_buckets = self.fresh_token_buckets = self.fresh_seq_buckets = ()
        if not prefill:
            self.prefill_buckets = ()
        for n in self.prefill_buckets:
            key, meta, rows = ("prefill", n), self._prefill_meta(n), self._prefill_rows(n)

            def prefill_forward(meta=meta, rows=rows) -> torch.Tensor:
                with self.model.graphed_attention():  # as the graph it stands in for
                    return self.model.logits(rows[0], meta, self.kv_caches, meta.logits_indices)

            self.logits[key] = prefill_forward()
            self.graphs[key] = EagerReplay(prefill_forward, self.logits[key])  # type: ignore[assignment]
            self.metas[key] = meta
        for bs in self.decode_buckets:
            key, meta = ("decode", bs), self._decode_meta(bs)

            def forward(bs=bs, meta=meta) -> torch.Tensor:
                with self.model.graphed_attention():
                    return self.model.logits(self.inputs[0, :bs], meta, self.kv_caches, None)

            self.logits[key] = forward()
            self.graphs[key] = EagerReplay(forward, self.logits[key])  # type: ignore[assignment]
            self.metas[key] = meta

    @torch.inference_mode()
    def capture(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Capture every graph; with the sampler's ``argmax``, compile it for every decode bucket's width now (a
        decode window takes each step's argmax eagerly), not while serving."""
        self.inputs[2].fill_(-1)  # warm-up and capture must not write the KV cache
        for bs in reversed(self.decode_buckets):  # largest first: the shared pool is sized once
            self._capture(("decode", bs), self._decode_meta(bs))
        if argmax is not None:
            for bs in self.decode_buckets:
                argmax(self.logits[("decode", bs)])
        for n in reversed(self.prefill_buckets):
            self._capture(("prefill", n), self._prefill_meta(n))
        try:
            for c in reversed(self.context_buckets):
                for n in reversed([b for b in self.chunk_buckets if b < c]):
                    self.ctx_cu.copy_(torch.tensor([0, n, 0, c], dtype=torch.int32))  # the warm-ups' one chunk
                    self._capture(("chunk", n, c), self._chunk_meta(n, c))
        except RuntimeError as exc:  # e.g. an attention backend that cannot be captured: those chunks run eagerly
            log.warning("chunk-after-context graphs not captured (%s): such chunks run eagerly", exc)
            for key in [k for k in self.graphs if k[0] == "chunk"]:
                del self.graphs[key], self.logits[key], self.metas[key]
            self.chunk_buckets = ()
        try:
            for t in reversed(self.fresh_token_buckets):
                for sb in reversed(self.fresh_seq_buckets):
                    even = np.linspace(0, t, sb + 1).astype(np.int64)  # the warm-ups' prompts: sb of t // sb
                    self.fresh_cu[: sb + 1].copy_(torch.from_numpy(even))
                    self._capture(("fresh", t, sb), self._fresh_meta(t, sb))
        except RuntimeError as exc:  # FlashAttention's varlen call missing or not capturable here
            log.warning("several-fresh-prompt graphs not captured (%s): such steps run piecewise", exc)
            for key in [k for k in self.graphs if k[0] == "fresh"]:
                del self.graphs[key], self.logits[key], self.metas[key]
            self.fresh_token_buckets = self.fresh_seq_buckets = ()
        torch.cuda.synchronize(self.device)
        log.info("captured %d CUDA graphs", len(self.graphs))

    # ------------------------------------------------------------------ replay
    def decode_bucket(self, n: int) -> int | None:
        return next((b for b in self.decode_buckets if b >= n), None)

    def prefill_bucket(self, n: int) -> int | None:
        return next((b for b in self.prefill_buckets if b >= n), None)

    def fresh_bucket(self, tokens: int, prompts: int) -> tuple[int, int] | None:
        """The (tokens, prompts) graph for a step of ``prompts`` fresh prompts of ``tokens`` in all, if captured."""
        t = next((b for b in self.fresh_token_buckets if b >= tokens), None)
        s = next((b for b in self.fresh_seq_buckets if b >= prompts), None)
        return None if t is None or s is None or ("fresh", t, s) not in self.graphs else (t, s)

    def chunk_bucket(self, n: int, context: int) -> tuple[int, int] | None:
        """The (chunk, context) graph for ``n`` new tokens after ``context - n`` cached ones, if captured."""
        b = next((b for b in self.chunk_buckets if b >= n), None)
        if b is None:
            return None
        c = next((c for c in self.context_buckets if c >= context and c > b), None)
        return None if c is None else (b, c)

    def decode(self, ids, positions, slots, context_lens, tables) -> torch.Tensor:
        n = len(ids)
        bs = self.decode_bucket(n)
        assert bs is not None  # the runner replays only a captured size (it asked decode_bucket)
        host = self.host.numpy()
        host[0, :n], host[1, :n], host[2, :n], host[3, :n] = ids, positions, slots, context_lens
        host[:, n:bs] = 0
        host[2, n:bs] = -1
        host[3, n:bs] = 1
        t = self.host_tables.numpy()
        for i, row in enumerate(tables):
            t[i, : len(row)] = row
        self.inputs[:, :bs].copy_(self.host[:, :bs], non_blocking=True)
        self.tables[:bs].copy_(self.host_tables[:bs], non_blocking=True)
        self.graphs[("decode", bs)].replay()
        return self.logits[("decode", bs)][:n]

    def decode_multi(self, ids, positions, tables, allowed: list[int], steps: int, argmax) -> list[list[int]]:
        """``steps`` greedy decode steps back to back on the device, each step's argmax feeding the next, one
        host sync at the end. Row i runs ``allowed[i]`` real steps; later steps of that row write no KV
        (slot -1) and their tokens are discarded by the caller. Returns tokens[step][row]."""
        w = self.launch_window(ids, positions, tables, allowed, steps, argmax)
        self.wait_window(w)
        return w.grid()[:, : w.n].tolist()

    def launch_window(
        self, ids, positions, tables, allowed: list[int], steps: int, argmax, carry: list[int] | None = None
    ) -> DecodeWindow:
        """Queue ``decode_multi``'s window and return without waiting for it; ``window_tokens`` reads it.
        ``ids``: each row's input token, from the host; or None with ``carry``: row i continues from the last
        token of row ``carry[i]`` of the window launched just before, still on the device (asynchronous
        scheduling launches a window before the last one's tokens are read). The window's host buffers alternate
        between two sets, so writing this one's never touches what the window before may still be copying."""
        n = len(positions)
        bs = self.decode_bucket(n)
        assert bs is not None  # the runner replays only a captured size (it asked decode_bucket)
        w = self.windows[self._next_window]
        self._next_window ^= 1
        self.wait_window(w)  # its last use (two windows back) has left the buffers
        t = w.host_tables.numpy()
        for i, row in enumerate(tables):
            t[i, : len(row)] = row
        t[n:bs] = 0
        pos0 = np.asarray(positions, dtype=np.int64)
        k = np.arange(steps, dtype=np.int64)[:, None]
        pos = pos0[None, :] + k  # (steps, n)
        live = k < np.asarray(allowed, dtype=np.int64)[None, :]
        pos = np.where(live, pos, pos0[None, :])
        slots = slot_of(t, pos, self.block_size, rows=np.arange(n)[None, :])
        # the plan and the tokens as (steps, 3, bs) / (steps, bs) arrays at the start of their buffers: each
        # crosses between host and device in one contiguous copy
        host_plan = w.host_plan.view(-1)[: steps * 3 * bs].view(steps, 3, bs)
        plan = host_plan.numpy()
        plan[:] = 0
        plan[:, 0, :n] = pos
        plan[:, 1, :n] = np.where(live, slots, -1)
        plan[:, 1, n:] = -1
        plan[:, 2, :n] = np.where(live, pos + 1, pos0[None, :] + 1)
        plan[:, 2, n:] = 1
        dev_plan = self.plan.view(-1)[: steps * 3 * bs].view(steps, 3, bs)
        self.tables[:bs].copy_(w.host_tables[:bs], non_blocking=True)
        dev_plan.copy_(host_plan, non_blocking=True)
        if carry is None:
            h = w.host_ids.numpy()
            h[:n] = ids
            h[n:bs] = 0
            self.inputs[0, :bs].copy_(w.host_ids[:bs], non_blocking=True)
        else:
            self.carried_windows += 1
            if carry != list(range(n)):  # rows left out: gather the others' last tokens into rows 0 … n - 1
                w.host_rows.numpy()[:n] = carry
                rows = w.host_rows[:n].to(self.device, non_blocking=True)
                self.inputs[0, :n].copy_(self.inputs[0].index_select(0, rows))
        # else the rows are the last window's, in its order: its last step left their tokens in inputs[0]
        graph, logits = self.graphs[("decode", bs)], self.logits[("decode", bs)]
        tokens = self.step_tokens.view(-1)[: steps * bs].view(steps, bs)
        for step in range(steps):  # a step: the plan's row, the graph, the argmax (two passes) into the step's
            self.inputs[1:4, :bs].copy_(dev_plan[step])  # token row, and that row fed to the next step
            graph.replay()
            argmax(logits, out=tokens[step])
            self.inputs[0, :bs].copy_(tokens[step])
        w.n, w.bs, w.steps, w.allowed, w.pending = n, bs, steps, list(allowed), True
        w.grid().copy_(tokens, non_blocking=True)
        if w.done is not None:
            w.done.record()
        return w

    def wait_window(self, w: DecodeWindow) -> None:
        """Until window ``w`` is done on the device (its tokens copied back to the host)."""
        if w.pending:
            with self.device_wait():
                if w.done is not None:
                    w.done.synchronize()
            w.pending = False

    def window_tokens(self, w: DecodeWindow) -> list[list[int]]:
        """Each row's tokens of a launched window, row i's first ``allowed[i]`` (what it may emit)."""
        self.wait_window(w)
        rows = w.grid()[:, : w.n].numpy().T.tolist()
        return [row[:a] for row, a in zip(rows, w.allowed, strict=True)]

    def prefill(self, ids, slots) -> torch.Tensor:
        n = len(ids)
        bucket = self.prefill_bucket(n)
        assert bucket is not None  # the runner replays only a captured size (it asked prefill_bucket)
        staged = self.prefill_host[: 4 * bucket]
        host = staged.view(4, bucket).numpy()
        host[0, :n] = ids
        host[1] = np.arange(bucket)
        host[2, :n] = slots
        host[0, n:] = 0
        host[2, n:] = -1  # padding tokens come after the prompt: causal attention keeps them out of it
        host[3, 0] = n - 1
        self._prefill_rows(bucket).view(-1).copy_(staged, non_blocking=True)
        self.graphs[("prefill", bucket)].replay()
        return self.logits[("prefill", bucket)]

    def fresh(self, rows: np.ndarray, cu: list[int], logits_rows: list[int]) -> torch.Tensor:
        """A step of several fresh prompts: ``rows`` their packed ``(3, n)`` ids / positions / slots, ``cu`` the
        prompts' row offsets (``[0, …, n]``), ``logits_rows`` the rows whose logits are needed; returns those."""
        n, k = rows.shape[1], len(cu) - 1
        bucket = self.fresh_bucket(n, k)
        assert bucket is not None  # the runner replays only a captured size (it asked fresh_bucket)
        t, s = bucket
        fill_fresh_inputs(self.host.numpy(), self.host_fresh.numpy(), rows, cu, logits_rows, t, s)
        self.inputs[:3, :t].copy_(self.host[:3, :t], non_blocking=True)
        self.fresh_inputs[: 2 * s + 1].copy_(self.host_fresh[: 2 * s + 1], non_blocking=True)
        self.fresh_cu[: s + 1].copy_(self.fresh_inputs[: s + 1])
        self.fresh_rows[:s].copy_(self.fresh_inputs[s + 1 : 2 * s + 1])
        self.graphs[("fresh", t, s)].replay()
        self.fresh_replays += 1
        return self.logits[("fresh", t, s)][: len(logits_rows)]

    def chunk(self, ids, start: int, context_slots) -> torch.Tensor:
        """One chunk of ``len(ids)`` tokens at positions ``start …`` whose context (cached tokens and its own:
        ``context_slots``, the chunk's own last, already in the cache once the layer's KV write ran) it attends;
        logits of its last row."""
        bucket = self.chunk_bucket(len(ids), len(context_slots))
        assert bucket is not None  # the runner replays only a captured size (it asked chunk_bucket)
        b, c = bucket
        fill_chunk_inputs(self.host.numpy(), self.host_ctx.numpy(), ids, start, context_slots, b, c)
        self.inputs[:, :b].copy_(self.host[:, :b], non_blocking=True)
        self.ctx[: c + 4].copy_(self.host_ctx[: c + 4], non_blocking=True)
        self.ctx_cu.copy_(self.ctx[c : c + 4])
        self.graphs[("chunk", b, c)].replay()
        self.chunk_replays += 1
        return self.logits[("chunk", b, c)]


def bucket_blocks(buckets: tuple[int, ...], device) -> tuple[torch.Tensor, dict[int, int]]:
    """One device buffer holding a ``(4, b)`` input block (ids, positions, slots, logits row) for each bucket ``b``,
    none overlapping, and each block's offset (``bucket_rows``). Slots start at -1: a capture's warm-ups and the
    capture itself write no KV."""
    at = dict(zip(buckets, (4 * np.cumsum([0, *buckets])).tolist(), strict=False))
    buf = torch.zeros(4 * sum(buckets), dtype=torch.int64, device=device)
    for b in buckets:
        bucket_rows(buf, at, b)[2].fill_(-1)
    return buf, at


def bucket_rows(buf: torch.Tensor, at: dict[int, int], b: int) -> torch.Tensor:
    """Bucket ``b``'s ``(4, b)`` block of a ``bucket_blocks`` buffer."""
    return buf[at[b] : at[b] + 4 * b].view(4, b)


def prefill_metadata(inputs: torch.Tensor, n: int, gather: ContextGather | None = None) -> AttentionMetadata:
    """One prefill chunk of ``n`` rows over the static ``inputs`` (ids, positions, slots, logits row): a fresh
    prompt, or with ``gather`` a chunk that continues a cached context."""
    return AttentionMetadata(
        positions=inputs[1, :n],
        slot_mapping=inputs[2, :n],
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefill_block_tables=None,
        prefill_cu_seqlens_q=None,
        prefill_context_lens=None,
        logits_indices=inputs[3, :1],
        prefill_cu_seqlens_host=[0, n],
        prefill_num_fresh=0 if gather is not None else 1,
        prefill_gather=gather,
    )


def fresh_metadata(
    inputs: torch.Tensor, cu: torch.Tensor, logits_rows: torch.Tensor, t: int, s: int
) -> AttentionMetadata:
    """The metadata a (tokens ``t``, prompts ``s``) graph of several fresh prompts is captured with, over the static
    buffers: ``inputs`` rows (ids, positions, slots), ``cu[: s + 1]`` the prompts' offsets (zero-length prompts pad
    it; rows past the last offset belong to none), ``logits_rows[:s]``. The host offsets are the bucket's bounds:
    the attention takes all ``t`` rows and ``t`` as the longest prompt, an upper bound."""
    return AttentionMetadata(
        positions=inputs[1, :t],
        slot_mapping=inputs[2, :t],
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefill_block_tables=None,
        prefill_cu_seqlens_q=cu[: s + 1],
        prefill_context_lens=None,
        logits_indices=logits_rows[:s],
        prefill_cu_seqlens_host=[0] + [t] * s,
        prefill_num_fresh=s,
    )


def fill_fresh_inputs(
    host: np.ndarray, host_fresh: np.ndarray, rows: np.ndarray, cu: list[int], logits_rows: list[int], t: int, s: int
) -> None:
    """A step of several fresh prompts into the host buffers of bucket (``t``, ``s``): ``host[:3, :t]`` the rows,
    padded with token 0, position 0 and slot -1 (no KV write); ``host_fresh[: s + 1]`` the offsets, padded with
    zero-length prompts at the end; ``host_fresh[s + 1 : 2s + 1]`` the logits rows, padded with row 0."""
    n, k = rows.shape[1], len(cu) - 1
    host[:3, :n] = rows
    host[:2, n:t] = 0
    host[2, n:t] = -1
    host_fresh[: k + 1] = cu
    host_fresh[k + 1 : s + 1] = n
    host_fresh[s + 1 : s + 1 + len(logits_rows)] = logits_rows
    host_fresh[s + 1 + len(logits_rows) : 2 * s + 1] = 0


def chunk_metadata(inputs: torch.Tensor, ctx: torch.Tensor, ctx_cu: torch.Tensor, n: int, c: int) -> AttentionMetadata:
    """The metadata a (chunk ``n``, context ``c``) graph is captured with, over the static buffers: ``inputs``
    rows (ids, positions, slots, logits row), ``ctx[:c]`` the context's slots, ``ctx_cu`` = (cu_q, cu_k)."""
    return prefill_metadata(inputs, n, ContextGather(ctx[:c], ctx_cu[:2], ctx_cu[2:4], [0, n], [0, c]))


def fill_chunk_inputs(host: np.ndarray, host_ctx: np.ndarray, ids, start: int, context_slots, b: int, c: int):
    """A chunk's inputs into the host buffers of bucket (``b``, ``c``); its own KV slots are the context's from
    ``start``. Padding rows have token 0, position 0 and slot -1 (no KV write; past ``cu_q``, attention leaves
    them out); padding context entries read slot 0, past ``cu_k``. ``host_ctx[c : c + 4]`` receives (cu_q, cu_k)."""
    n, c_len = len(ids), len(context_slots)
    host[0, :n], host[0, n:b] = ids, 0
    host[1, :n], host[1, n:b] = np.arange(start, start + n), 0
    host[2, :n], host[2, n:b] = context_slots[start:], -1
    host[3, 0] = n - 1
    host_ctx[:c_len], host_ctx[c_len:c] = context_slots, 0
    host_ctx[c : c + 4] = (0, n, 0, c_len)


# Token buckets of the piecewise graphs: powers of two and their midpoints up to 4,096, then every 1,024 (a large
# step is GPU-bound, so a bucket there should pad few rows).
PIECEWISE_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, *range(4096, 65537, 1024))


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated (PyTorch's CUDA-graph trees hold
    their outputs the same way). A piece's outputs are read by the eager attention that follows it, before the
    next piece (captured later, from the same pool) may reuse their memory: replays run in capture order."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


class PiecewiseGraphs:
    """Steps that prefill (fresh prompts, chunks after a cached context, with or without decode rows) replay
    CUDA graphs of the row-wise parts of the forward, captured per token bucket, and run attention eagerly in
    between (vLLM's piecewise graphs). Such a step ran all ~280 launches of its forward eagerly: on the H200's host
    a Triton launch costs ~85 µs of Python, so a 16k-token prefill step spent ~12 ms launching, on a thread that
    the worker's I/O threads and the gateway processes compete for. Here a step launches L + 1 graphs, L
    attention calls and L output projections.

    Piece 0 embeds and runs layer 0 up to attention (norm, QKV projection, RoPE, KV write); piece i runs layer
    i - 1's residual add, norm and MLP, then layer i up to attention; piece L ends with the final norm. Between
    pieces i and i + 1 the step's attention reads piece i's q, k, v and the output projection writes into a
    static buffer that piece i + 1 reads. Padding rows (bucket - T) have token 0, position 0 and slot -1 (no KV
    write); the attention leaves them out and nothing reads their outputs.

    Memory: all buckets' pieces share one graph pool and hold their outputs through ``weak_view``s, so the pool
    holds one bucket's working set, not one per layer and bucket. Without ``capture`` (a CPU, tests) the same
    pieces run eagerly over the same static buffers."""

    def __init__(
        self,
        model,
        kv_caches,
        device,
        max_tokens: int,
        buckets: tuple[int, ...] = PIECEWISE_BUCKETS,
        pool=None,
    ):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.num_layers = len(kv_caches)
        self.buckets = (*(b for b in buckets if b < max_tokens), max_tokens)
        n = self.buckets[-1]
        cuda = torch.device(device).type == "cuda"
        # Each bucket's ids, positions, slots (and a logits row that only the fresh-prompt metadata's form needs) as
        # a contiguous (4, b) block of its own (``rows``; the blocks do not overlap, as GraphRunner's prefill ones):
        # the step's three rows cross from the host in one copy (a (3, b) slice of a (4, n) buffer took torch a
        # pageable temporary and a device kernel).
        self.host = torch.zeros(4 * n, dtype=torch.int64, pin_memory=cuda)
        self.block, self._at = bucket_blocks(self.buckets, device)
        dtype = model.model.embed_tokens.weight.dtype
        self.attn_out = torch.zeros((n, model.cfg.hidden_size), dtype=dtype, device=device)
        # The pieces' metadata: only positions and slots (RoPE, the KV write) are read inside a piece.
        self.metas = {b: prefill_metadata(self.rows(b), b) for b in self.buckets}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.qkv: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.final: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.copied = torch.cuda.Event() if cuda else None  # the last host → device copy of the inputs
        self.replays = 0  # steps replayed so far (the gate checks they happen)
        self.capture_s = 0.0  # what the capture cost (the runner records it): time, and memory it reserved
        self.reserved_bytes = 0

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def rows(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s static inputs: ``(4, b)`` ids, positions, slots, logits row, contiguous, its own."""
        return bucket_rows(self.block, self._at, b)

    def _piece(self, b: int, i: int, residual: torch.Tensor | None):
        """Piece ``i`` of bucket ``b``: ``(q, k, v, residual)`` of layer i, or for i = L the final hidden."""
        m = self.model
        if i == 0:
            hidden = m.embed(self.rows(b)[0])
        else:
            assert residual is not None  # every piece after the first continues the residual stream
            hidden, residual = m.post_attention(i - 1, self.attn_out[:b], residual)
        if i == self.num_layers:
            assert residual is not None
            return m.final_norm(hidden, residual)
        return m.pre_attention(i, hidden, residual, self.metas[b], self.kv_caches[i])

    def _attend(self, i: int, t: int, q, k, v, meta: AttentionMetadata) -> None:
        o = self.model.attend(q[:t], k[:t], v[:t], meta, self.kv_caches[i])
        torch.mm(o, self.model.o_proj_weight(i).t(), out=self.attn_out[:t])

    @torch.inference_mode()
    def capture(self) -> None:
        for b in reversed(self.buckets):  # largest first: the shared pool is sized once
            for _ in range(2):  # warm up: Triton compilation, cuBLAS's choices (no attention needed for that)
                residual = None
                for i in range(self.num_layers + 1):
                    out = self._piece(b, i, residual)
                    residual = out[3] if i < self.num_layers else None
            torch.cuda.synchronize(self.device)
            graphs, qkv = [], []
            residual = None
            for i in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._piece(b, i, residual)  # reads the previous piece's residual: held until now
                self.pool = graph.pool()
                graphs.append(graph)
                if i < self.num_layers:
                    q, k, v, residual = out
                    qkv.append((weak_view(q), weak_view(k), weak_view(v)))
                    del q, k, v  # their memory is the pool's again for the next pieces
                else:
                    self.final[b] = weak_view(out)
                del out
            self.graphs[b], self.qkv[b] = graphs, qkv
        torch.cuda.synchronize(self.device)

    def load(self, rows: np.ndarray) -> int:
        """The step's ``(3, T)`` ids / positions / slots into the static inputs, padded to their bucket."""
        t = rows.shape[1]
        b = self.bucket(t)
        assert b is not None  # the runner asks bucket() first
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        staged = self.host[: 3 * b]
        host = staged.view(3, b).numpy()  # the first three rows of the bucket's (4, b) block
        host[:, :t] = rows
        host[:, t:] = 0
        host[2, t:] = -1
        self.rows(b).view(-1)[: 3 * b].copy_(staged, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return b

    def run(self, t: int, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of a step whose ``t`` rows ``load`` put in place; ``meta``: its attention metadata.
        Returns the final hidden states of the bucket's rows (the first ``t`` are the step's)."""
        b = self.bucket(t)
        assert b is not None
        graphs = self.graphs.get(b)
        self.replays += graphs is not None
        residual = None
        for i in range(self.num_layers):
            if graphs is not None:
                graphs[i].replay()
                q, k, v = self.qkv[b][i]
            else:
                q, k, v, residual = self._piece(b, i, residual)
            self._attend(i, t, q, k, v, meta)
        if graphs is not None:
            graphs[-1].replay()
            return self.final[b]
        return self._piece(b, self.num_layers, residual)
