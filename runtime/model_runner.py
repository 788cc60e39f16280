"""The model runner owns tensors: weights, the paged KV cache, per-step inputs, logits and sampling."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kernellab.runtime import ops as torch_ops
from kernellab.runtime.attention import (
    AttentionMetadata,
    ContextGather,
    LayerKV,
    warm_decode_launches,
    warm_prefill_launches,
)
from kernellab.runtime.config import EngineConfig, ModelConfig
from kernellab.runtime.dispatch import Ops, build_ops, describe_fast_path, fast_path, graph_safe
from kernellab.runtime.graphs import FRESH_TOKEN_BUCKETS, DecodeWindow, GraphRunner, PiecewiseGraphs
from kernellab.runtime.host_gate import HostGate
from kernellab.runtime.model import CausalLM
from kernellab.runtime.request.block_manager import slot_of
from kernellab.runtime.request.outputs import TokenLogprob
from kernellab.runtime.request.scheduler import SchedulerOutput
from kernellab.runtime.request.sequence import Sequence
from kernellab.runtime.sampler import Sampler, token_logprobs

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, preferred: str = "bfloat16") -> torch.dtype:
    """ "auto": the model's serving dtype on a GPU; on a CPU bf16 where the CPU has native bf16 dot
    products (AVX512-BF16/AMX: half the weight bytes per token), else fp32."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda":
        return DTYPES.get(preferred, torch.bfloat16)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def _slots(table: list[int], start: int, n: int, bs: int) -> np.ndarray:
    """KV slots (int64) of positions ``start .. start + n - 1``: vectorized for prompt chunks (a 16k-token prefill
    step spent ~3 ms of host time in a per-token loop), a plain loop for the few tokens where numpy's call costs
    more."""
    if n < 64:
        return np.array([slot_of(table, p, bs) for p in range(start, start + n)], dtype=np.int64)
    # each block's slots in one broadcast, then the range's: ~2x the per-position index arithmetic's speed
    b0 = start // bs
    blocks = np.asarray(table[b0 : -(-(start + n) // bs)], dtype=np.int64)
    off = start - b0 * bs
    return (blocks[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)[off : off + n]


def host_gate_for(device: torch.device) -> HostGate | None:
    """A gate marked by a CUDA event, so it knows when the device is done; None off CUDA (a CPU step is host
    work throughout). It lives here, not in host_gate, which the torch-free worker imports."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    return HostGate(event.query, event.record)


@dataclass
class StepPlan:
    """A step's rows as the host plans them (``ModelRunner.plan``)."""

    order: list[int]  # the scheduled entries in row order
    sampling: list[Sequence]  # the sequences that sample, in logits order
    rows: np.ndarray = field(default_factory=lambda: np.empty((3, 0), dtype=np.int64))  # ids, positions, slots
    logits_rows: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    dec_lens: list[int] = field(default_factory=list)
    pre_tables: list[list[int]] = field(default_factory=list)
    pre_lens: list[int] = field(default_factory=list)
    cu: list[int] = field(default_factory=lambda: [0])  # cumulative prefill rows
    num_fresh: int = 0  # prefill chunks with no cached context before them (ordered first)


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        weights=None,
        ops: Ops | None = None,
        int4_weights=None,
    ):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.device, self.dtype = device, dtype
        self.block_size = cfg.block_size
        self.max_model_len = max_model_len
        ops = build_ops("none", device) if ops is None else ops
        torch.manual_seed(cfg.seed)
        if device.type == "cuda":
            # cuDNN's SDPA builds an execution plan for every new (batch, length) shape: seconds over a run whose
            # prefill shapes all differ. FlashAttention has no per-shape setup.
            torch.backends.cuda.enable_cudnn_sdp(False)
        cos_sin = torch_ops.rope_cos_sin_cache(
            model_cfg.head_dim, max(max_model_len, 1), model_cfg.rope_theta, model_cfg.rope_scaling, device=device
        )
        with torch.device(device):
            self.model = CausalLM(model_cfg, ops, cos_sin)
        if weights is None:
            self._init_random()
        else:
            self.model.load_weights(weights)
        self.model.to(dtype=dtype)
        self.model.cos_sin_cache = cos_sin  # stays fp32
        if int4_weights is not None:
            n = self.model.attach_int4(int4_weights, dtype, cfg.int4_max_rows)
            log.info("int4 weights for %d linears (steps of at most %d rows)", n, cfg.int4_max_rows)
        self.kv_dtype = (
            torch_ops.FP8_DTYPE
            if cfg.kv_cache_dtype.startswith("fp8")
            else torch_ops.INT8_DTYPE
            if cfg.kv_cache_dtype == "int8"
            else dtype
        )
        if cfg.kv_cache_dtype.startswith("fp8"):
            log.warning(
                "the FP8 KV cache misses its numerics gate (H200, Qwen3-0.6B shape: 94.0 % agreement with HF fp32 "
                "against the 95.4 % required; docs/gpu-engine.md); the int8 cache passes it with the same bytes: "
                "kv_cache_dtype='int8'"
            )
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = [self._layer_cache() for _ in range(model_cfg.num_layers)]
        kv_bytes = sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv if t is not None)
        log.info(
            "KV cache: %d blocks of %d tokens, %s%s, %.2f GiB",
            self.num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            " with per-token scales" if self.kv_dtype in torch_ops.QUANTIZED_KV else "",
            kv_bytes / 2**30,
        )
        # Tells the serving worker's other threads when their Python costs the step nothing (None off CUDA).
        self.host_gate = host_gate_for(device)
        device_wait = self.host_gate.device_wait if self.host_gate is not None else contextlib.nullcontext
        self.sampler = Sampler(device, argmax=ops.argmax, device_wait=device_wait)
        self.graphs: GraphRunner | None = None
        self.use_graphs = False  # False replays nothing: the same runner, eager (graph == eager checks)
        if device.type == "cuda" and cfg.cuda_graphs and graph_safe(ops, model_cfg.qk_norm):
            self.graphs = GraphRunner(
                self.model,
                self.kv_caches,
                device,
                self.block_size,
                max_model_len,
                cfg.max_num_seqs,
                fresh_token_buckets=FRESH_TOKEN_BUCKETS if cfg.fresh_prompt_graphs else (),
                max_num_batched_tokens=cfg.max_num_batched_tokens,
            )
            self.graphs.device_wait = device_wait
            self.graphs.capture(self.sampler.argmax)
            self.use_graphs = True
        self.piecewise: PiecewiseGraphs | None = None
        self.use_piecewise = False  # steps that prefill replay piecewise graphs (False: eager; the gate's A/B)
        if self.graphs is not None and cfg.piecewise_graphs:
            self.piecewise = self._capture_piecewise()
            self.use_piecewise = self.piecewise is not None
        if self.graphs is not None:  # the decode attention of steps that mix decode rows with prompts
            t = time.perf_counter()
            n = warm_decode_launches(
                ops, self.kv_caches[0], self.graphs.width, cfg.max_num_seqs, model_cfg.num_heads, self.model.scale,
                dtype,
            )  # fmt: skip
            torch.cuda.synchronize(device)
            log.info("eager decode attention warmed for 1-%d rows in %.1fs", n, time.perf_counter() - t)
        if device.type == "cuda":  # the Triton prefill attention of steps whose fresh prompts run eagerly
            t = time.perf_counter()
            max_prompts = min(cfg.max_num_seqs, cfg.max_num_batched_tokens // 2)  # a fresh prompt has 2+ tokens
            n = warm_prefill_launches(
                ops, model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, max_prompts, self.model.scale,
                dtype, device,
            )  # fmt: skip
            if n:
                torch.cuda.synchronize(device)
                log.info("prefill attention warmed for up to %d prompts in %.1fs", max_prompts, time.perf_counter() - t)
        # The widest decode window: num_scheduler_steps replays on captured graphs, else single steps. Auto (0): 4
        # with asynchronous scheduling, whose look-ahead hides the host's turn-around at any width, so a shorter
        # window only shortens what an arrival waits for (H200: the same throughput and batch-1 ITL as windows of
        # 16 / 8, an arrival's TTFT 20.6 against 39.5 ms; results/gpu/engine_h200_dev/async_scheduling_ab_*.json);
        # 8 without it, where each window's turn-around leaves the device idle.
        auto = 4 if cfg.async_scheduling else 8
        self.max_window = min(cfg.num_scheduler_steps or auto, self.graphs.max_steps) if self.graphs is not None else 1
        self.fast_path = fast_path(ops, model_cfg.qk_norm, device, cfg.cuda_graphs, self.max_window)
        self.fast_path["piecewise_graphs"] = self.piecewise is not None
        self.fast_path["async_scheduling"] = cfg.async_scheduling and self.max_window > 1
        self.fast_path["fresh_prompt_graphs"] = (
            sum(k[0] == "fresh" for k in self.graphs.graphs) if self.graphs is not None else 0
        )
        log.info("fast path: %s", describe_fast_path(self.fast_path))

    def graphs_on(self, on: bool) -> None:
        """Replay the captured graphs (whole-step and piecewise) where they exist, or run every step eagerly (the
        same runner: the graph == eager checks)."""
        self.use_graphs = on and self.graphs is not None
        self.use_piecewise = on and self.piecewise is not None

    def _capture_piecewise(self) -> PiecewiseGraphs | None:
        assert self.graphs is not None  # the piecewise graphs share the other graphs' pool
        t = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        pw = PiecewiseGraphs(
            self.model, self.kv_caches, self.device, self.cfg.max_num_batched_tokens, pool=self.graphs.pool
        )
        try:
            pw.capture()
        except RuntimeError as exc:  # e.g. an op that cannot be captured: such steps run eagerly
            log.warning("piecewise CUDA graphs not captured (%s): steps that prefill run eagerly", exc)
            return None
        self.graphs.pool = pw.pool
        pw.capture_s = time.perf_counter() - t
        pw.reserved_bytes = torch.cuda.memory_reserved(self.device) - reserved
        n = sum(len(g) for g in pw.graphs.values())
        log.info("captured %d piecewise CUDA graphs (%d token buckets) in %.1fs", n, len(pw.graphs), pw.capture_s)
        return pw

    @torch.inference_mode()
    def _init_random(self) -> None:
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)

    def _layer_cache(self) -> LayerKV:
        shape = (self.num_blocks, self.block_size, self.model_cfg.num_kv_heads, self.model_cfg.head_dim)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        if self.kv_dtype not in torch_ops.QUANTIZED_KV:
            return LayerKV(zeros(shape, self.kv_dtype), zeros(shape, self.kv_dtype))
        # scales start at 0, so a slot never written reads as zeros, as in the other dtypes
        return LayerKV(
            zeros(shape, self.kv_dtype),
            torch_ops.v_cache_zeros(shape, self.kv_dtype, self.device),
            torch_ops.scale_zeros(shape[:3], self.kv_dtype, self.device),
            torch_ops.scale_zeros(shape[:3], self.kv_dtype, self.device),
        )

    def _num_kv_blocks(self) -> int:
        if self.cfg.num_kv_blocks:
            return self.cfg.num_kv_blocks
        quantized = self.kv_dtype in torch_ops.QUANTIZED_KV
        value_bytes = self.kv_dtype.itemsize
        block_bytes = self.block_size * self.model_cfg.kv_bytes_per_token(value_bytes, 4 if quantized else 0)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.cfg.gpu_memory_utilization) - 2 * 2**30  # activations, graphs
        else:
            budget = (self.cfg.kv_cache_memory_gib or 0.5) * 2**30
        return max(int(budget // block_bytes), 1)  # fewer than a full context: the engine limits requests to it

    # ------------------------------------------------------------------ one step
    def plan(self, out: SchedulerOutput) -> StepPlan:
        """The step's rows on the host: decode rows (one query token) first, then fresh prompts, then chunks that
        continue a cached context (attention takes the fresh ones in one batched call and only the others from the
        cache: a step mixing them once sent every chunk of the step through the per-sequence cache path, 157 ms
        for 12k tokens on the H200 where 16k fresh take ~70). Token ids, positions and KV slots are one int64
        ``(3, T)`` array built with numpy: a 16k-token step spent ~3.4 ms of host time turning Python lists into
        tensors."""
        sched = out.scheduled
        order = sorted(
            range(len(sched)),
            key=lambda i: (sched[i][1] != 1, sched[i][1] != 1 and sched[i][0].num_computed_tokens > 0),
        )
        bs = self.block_size
        ids: list[int] = []
        starts, lens = np.empty(len(order), dtype=np.int64), np.empty(len(order), dtype=np.int64)
        dec_slots: list[int] = []
        pre_slots: list[np.ndarray] = []
        logits_rows: list[int] = []
        sampling: list[Sequence] = []
        plan = StepPlan(order=order, sampling=sampling)
        for j, i in enumerate(order):
            seq, n = sched[i]
            start = seq.num_computed_tokens
            starts[j], lens[j] = start, n
            ids.extend(seq.token_ids[start : start + n])
            table = seq.block_table
            if n == 1:
                dec_slots.append(slot_of(table, start, bs))
                plan.dec_tables.append(table)
                plan.dec_lens.append(start + 1)
            else:
                pre_slots.append(_slots(table, start, n, bs))
                plan.pre_tables.append(table)
                plan.pre_lens.append(start + n)
                plan.cu.append(plan.cu[-1] + n)
                plan.num_fresh += start == 0
            if out.samples(seq, n):
                logits_rows.append(len(ids) - 1)
                sampling.append(seq)
        total = len(ids)
        rows = np.empty((3, total), dtype=np.int64)
        rows[0] = ids
        offsets = np.cumsum(lens) - lens
        rows[1] = np.arange(total) + np.repeat(starts - offsets, lens)
        rows[2] = np.concatenate([np.asarray(dec_slots, dtype=np.int64), *pre_slots])
        plan.rows, plan.logits_rows = rows, logits_rows
        return plan

    def metadata(self, plan: StepPlan, rows: torch.Tensor) -> AttentionMetadata:
        """The step's attention metadata; ``rows``: the plan's ``(3, ≥T)`` ids/positions/slots on the device."""
        dev, total = self.device, plan.rows.shape[1]

        def table_tensor(tables, graph_width=False):
            if not tables:
                return None
            # Decode tables as wide as the graphs' so eager and replayed steps split attention identically.
            width = self.graphs.width if graph_width and self.graphs is not None else max(len(t) for t in tables)
            return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)

        cu, f = plan.cu, plan.num_fresh
        return AttentionMetadata(
            positions=rows[1, :total],
            slot_mapping=rows[2, :total],
            num_decode_tokens=len(plan.dec_lens),
            decode_block_tables=table_tensor(plan.dec_tables, graph_width=True),
            decode_context_lens=torch.tensor(plan.dec_lens, dtype=torch.int32, device=dev) if plan.dec_lens else None,
            prefill_block_tables=table_tensor(plan.pre_tables),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev) if plan.pre_tables else None,
            prefill_context_lens=torch.tensor(plan.pre_lens, dtype=torch.int32, device=dev) if plan.pre_lens else None,
            logits_indices=torch.tensor(plan.logits_rows, dtype=torch.long, device=dev),
            max_decode_context=max(plan.dec_lens, default=0),
            prefill_cu_seqlens_host=cu,
            prefill_num_fresh=f,
            prefill_gather=ContextGather.build(
                plan.pre_tables[f:],
                plan.pre_lens[f:],
                [b - a for a, b in itertools.pairwise(cu[f:])],
                self.block_size,
                dev,
            )
            if len(plan.pre_tables) > f
            else None,
        )

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list[int], list[Sequence]]:
        """The eager step's inputs: token ids, metadata, the position of each scheduled entry in the step's row
        order, and the sequences that sample, in logits order."""
        plan = self.plan(out)
        rows = torch.from_numpy(plan.rows).to(self.device)
        return rows[0], self.metadata(plan, rows), plan.order, plan.sampling

    def decode_window(self, out: SchedulerOutput) -> int:
        """How many greedy decode steps this batch can run back to back on the device, one host sync at the end
        (vLLM's multi-step scheduling; ``EngineConfig.num_scheduler_steps``, 0 = 4 with asynchronous scheduling, 8
        without, on captured graphs; else 1).
        Only for an all-decode batch of a captured bucket whose rows take the raw argmax: no logprobs,
        penalties, logit_bias or grammars. The scheduler then reserves the window's KV slots."""
        graphs = self.graphs if self.use_graphs else None
        if self.max_window <= 1 or graphs is None or not graphs.decode_bucket(len(out.scheduled)):
            return 1
        for seq, n in out.scheduled:
            p = seq.params
            if n != 1 or not out.samples(seq, n) or not p.greedy or p.has_logits_processors or p.logprobs is not None:
                return 1
        return self.max_window

    @torch.inference_mode()
    def launch_window(self, out: SchedulerOutput, carry: list[int] | None = None) -> DecodeWindow:
        """Queue the decode window ``out.window`` on the device and return at once (``window_tokens`` reads it).
        Each row starts ``out.ahead`` tokens past what its sequence holds; with ``carry`` (asynchronous
        scheduling: the window before this one is not read yet) row i continues from row ``carry[i]``'s last
        token of that window, still on the device."""
        assert self.graphs is not None  # decode_window gives a window only with captured graphs
        seqs = [s for s, _ in out.scheduled]
        pos = [s.num_computed_tokens + out.ahead for s in seqs]
        ids = None if carry is not None else [s.token_ids[p] for s, p in zip(seqs, pos, strict=True)]
        tables = [s.block_table for s in seqs]
        return self.graphs.launch_window(ids, pos, tables, out.allowed, out.window, self.sampler.argmax, carry)

    def window_tokens(self, window: DecodeWindow) -> list[list[int]]:
        """A launched window's tokens by row, each row's first ``allowed`` (waits for the device)."""
        assert self.graphs is not None
        return self.graphs.window_tokens(window)

    def eager_windows(self, steps: int = 8, prefill: bool = False) -> None:
        """Decode windows without CUDA graphs (a CPU): the decode buckets' forwards run eagerly over the graph
        runner's static buffers, so windows and asynchronous scheduling take the GPU's code path; with ``prefill``
        a lone fresh prompt's step takes the prefill graphs' path too. Tests use it."""
        self.graphs = GraphRunner(
            self.model, self.kv_caches, self.device, self.block_size, self.max_model_len, self.cfg.max_num_seqs
        )
        self.graphs.eager(prefill)
        self.use_graphs = True
        self.max_window = min(steps, self.graphs.max_steps)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, before_wait: Callable[[], None] | None = None
    ) -> tuple[list[list[int]], dict[str, TokenLogprob]]:
        """Run the step (or the decode window ``out.window``); returns each scheduled entry's sampled tokens, in
        ``out.scheduled`` order ([] for a non-final prefill chunk, one token, or up to ``out.allowed[i]`` in a
        window), and logprobs by request id where asked for (single steps only). ``before_wait`` (single steps):
        host work to run once the forward is launched, before anything waits for it."""
        if out.window > 1:
            return self.window_tokens(self.launch_window(out)), {}
        graphs = self.graphs if self.use_graphs else None
        if any(seq.wants_prompt_logprobs for seq, _ in out.scheduled):
            logits_and_seqs = self._execute_prompt_logprobs(out)  # needs every row's logits: eager
        else:
            logits_and_seqs = self._execute_graph(out, graphs) if graphs is not None else None
        if logits_and_seqs is None and self.use_piecewise and self.piecewise is not None:
            logits_and_seqs = self._execute_piecewise(out, self.piecewise)
        if logits_and_seqs is None:
            input_ids, meta, _, sampling = self.prepare(out)
            # graphs turned off (graphs_on(False): the graph == eager checks): a step that a whole-step graph would
            # replay runs eagerly with that graph's attention choice (attention.triton_prefill), the same forward
            shaped = not self.use_graphs and self.graphs is not None and self._whole_step_graph(out, self.graphs)
            with self.model.graphed_attention() if shaped else contextlib.nullcontext():
                if sampling:
                    logits = self.model.logits(input_ids, meta, self.kv_caches, meta.logits_indices)
                else:  # a prefill chunk that samples nothing: its KV writes only
                    self.model(input_ids, meta, self.kv_caches)
                    logits = None
        else:
            logits, sampling = logits_and_seqs
        if before_wait is not None:  # on a GPU, while the forward launched above runs
            before_wait()
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = None
        if sampling:
            assert logits is not None  # computed whenever a row samples
            # The sampler's host work (grammar masks) runs before it touches the logits: on a GPU, while the forward
            # launched above still runs.
            tokens, logprobs = self.sampler(logits, sampling)
        by_seq = {id(s): t for s, t in zip(sampling, tokens, strict=True)}
        sampled = [[by_seq[id(seq)]] if id(seq) in by_seq else [] for seq, _ in out.scheduled]
        lp = {s.request_id: lp for s, lp in zip(sampling, logprobs, strict=True)} if logprobs else {}
        return sampled, lp

    @staticmethod
    def _whole_step_graph(out: SchedulerOutput, graphs: GraphRunner) -> str | None:
        """Which captured whole-step graph takes the step, if any: ``decode`` (all decodes within a batch bucket),
        ``prefill`` (one fresh prompt within a prefill bucket), ``chunk`` (one chunk after a cached context) or
        ``fresh`` (several fresh prompts within a (tokens, prompts) bucket)."""
        sched = out.scheduled
        if all(n == 1 for _, n in sched) and graphs.decode_bucket(len(sched)):
            return "decode"
        if len(sched) == 1:
            seq, n = sched[0]
            start = seq.num_computed_tokens
            if n > 1 and start == 0 and out.samples(seq, n) and graphs.prefill_bucket(n):
                return "prefill"
            if n > 1 and start > 0 and graphs.chunk_bucket(n, start + n):
                return "chunk"
        fresh = len(sched) > 1 and all(n > 1 and s.num_computed_tokens == 0 for s, n in sched)
        if fresh and graphs.fresh_bucket(out.num_batched_tokens, len(sched)):
            return "fresh"
        return None

    def _execute_graph(self, out: SchedulerOutput, graphs: GraphRunner):
        """Replay a captured graph when the step has a captured shape (``_whole_step_graph``). Returns (logits of
        the sampling rows, their sequences)."""
        sched, bs = out.scheduled, self.block_size
        kind = self._whole_step_graph(out, graphs)
        if kind == "decode":
            pos = [s.num_computed_tokens for s, _ in sched]
            ids = [s.token_ids[p] for (s, _), p in zip(sched, pos, strict=True)]
            slots = [slot_of(s.block_table, p, bs) for (s, _), p in zip(sched, pos, strict=True)]
            logits = graphs.decode(ids, pos, slots, [p + 1 for p in pos], [s.block_table for s, _ in sched])
            rows = [i for i, (s, n) in enumerate(sched) if out.samples(s, n)]
            if len(rows) != len(sched):
                logits = logits[rows]
            return logits, [sched[i][0] for i in rows]
        if kind == "prefill":
            seq, n = sched[0]
            return graphs.prefill(seq.token_ids[:n], _slots(seq.block_table, 0, n, bs)), [seq]
        if kind == "chunk":  # a chunk after a cached context (a prefix-cache hit, the next chunk of a long prompt)
            seq, n = sched[0]
            start = seq.num_computed_tokens
            logits = graphs.chunk(seq.token_ids[start : start + n], start, _slots(seq.block_table, 0, start + n, bs))
            return (logits, [seq]) if out.samples(seq, n) else (None, [])
        if kind == "fresh":  # several fresh prompts (a burst's first step): one replay, not the pieces' ~85 launches
            plan = self.plan(out)
            logits = graphs.fresh(plan.rows, plan.cu, plan.logits_rows)
            return (logits, plan.sampling) if plan.sampling else (None, [])
        return None

    def _execute_prompt_logprobs(self, out: SchedulerOutput):
        """An eager step in which some prompt chunk wants its prompt logprobs (completions' echo with logprobs):
        the final hidden state of every row, the sampling rows' logits as any step gives them, and each such
        chunk's positions scored against the prompt token that follows them (``Sequence.prompt_logprobs``)."""
        input_ids, meta, order, sampling = self.prepare(out)
        hidden = self.model(input_ids, meta, self.kv_caches)
        row = 0
        for i in order:
            seq, n = out.scheduled[i]
            if seq.wants_prompt_logprobs:
                self._score_prompt(seq, hidden[row : row + n])
            row += n
        return (self.model.compute_logits(hidden[meta.logits_indices]), sampling) if sampling else (None, [])

    PROMPT_LOGPROB_ROWS = 512  # rows per LM-head pass: 512 × a 152k vocabulary of fp32 logits is 311 MB

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Append to ``seq.prompt_logprobs`` the entries this chunk's rows give: the row at position p scores
        prompt token p + 1 (raw log-softmax of the model's logits, as generated tokens' logprobs are), with the top
        ``params.prompt_logprobs`` at that position."""
        assert seq.prompt_logprobs is not None
        start, k = seq.num_computed_tokens, seq.params.prompt_logprobs or 0
        lo = max(start, len(seq.prompt_logprobs))  # positions before lo were scored by an earlier chunk
        hi = min(start + hidden.shape[0], seq.num_prompt_tokens - 1)
        for a in range(lo, hi, self.PROMPT_LOGPROB_ROWS):
            b = min(a + self.PROMPT_LOGPROB_ROWS, hi)
            logits = self.model.compute_logits(hidden[a - start : b - start])
            seq.prompt_logprobs.extend(token_logprobs(logits, seq.token_ids[a + 1 : b + 1].tolist(), [k] * (b - a)))

    def _execute_piecewise(self, out: SchedulerOutput, pw: PiecewiseGraphs):
        """A step within the largest token bucket through the piecewise graphs (any mix of rows)."""
        if pw.bucket(out.num_batched_tokens) is None:
            return None
        plan = self.plan(out)
        meta = self.metadata(plan, pw.rows(pw.load(plan.rows)))
        hidden = pw.run(plan.rows.shape[1], meta)
        if not plan.sampling:
            return None, []
        return self.model.compute_logits(hidden[meta.logits_indices]), plan.sampling
