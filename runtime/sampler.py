"""Sampling from a step's logits: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs.

Order on a row's logits: logit_bias, then the grammar mask (disallowed tokens → -inf), then penalties,
temperature and filters. Seeded rows draw their noise from a generator keyed on ``(seed, output index)``, so a
request's tokens do not depend on what else is in the batch, and a request resumed elsewhere from its emitted
tokens continues exactly. Logprobs are those of the raw model distribution (before bias, mask, temperature and
filtering), as vLLM and OpenAI report them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from kernellab.runtime import ops as reference
from kernellab.runtime.request.outputs import TokenLogprob
from kernellab.runtime.request.sequence import Sequence

_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier to spread (seed, index) pairs


@dataclass
class Constraints:
    """A step's logit_bias and grammar masks, prepared on the host."""

    bias: tuple[list[int], list[int], list[float]] | None  # (rows, token ids, biases) of the rows with a bias
    mask_rows: list[int]  # rows with a grammar, in bitmask row order
    bitmask: torch.Tensor | None  # host int32 (len(mask_rows), ceil(V/32)): bit t of a row set = t allowed


def _row_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + index) % (2**63 - 1))
    return g


class Sampler:
    def __init__(self, device: torch.device, argmax=reference.argmax, device_wait=contextlib.nullcontext):
        self.device = device
        self.argmax = argmax  # a row's greedy token: the dispatcher's (Triton on a GPU where accepted)
        self.device_wait = device_wait  # around the wait for the tokens (runtime/host_gate.py)
        self.generator = torch.Generator(device=device)
        self.generator.seed()
        self._bitmask_host: torch.Tensor | None = None  # grown to the most constrained rows seen; pinned on CUDA
        self._bit_shifts = torch.arange(32, dtype=torch.int32, device=device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob] | None]:
        """``logits: (S, V)``, one row per sequence that samples this step, fp32 or the model's dtype
        (``CausalLM.compute_logits``). Greedy rows without biases or masks take the argmax of the values as
        stored; anything that computes with them (biases, grammar masks, penalties, temperature) works on an fp32
        copy. Called right after the forward is launched: the host work (grammar masks) comes first, before
        anything waits for the device, so on a GPU it overlaps the forward."""
        constraints = self.constraints(seqs, logits.shape[-1])
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        greedy = all(s.params.greedy and not s.params.has_penalties for s in seqs)
        if constraints is None and greedy:
            tokens = self.argmax(logits)
        else:
            processed = logits.to(torch.float32, copy=True)  # never the caller's
            if constraints is not None:
                self._apply_constraints(processed, constraints)
            tokens = self.argmax(processed) if greedy else self._sample(processed, seqs)
        with self.device_wait():
            token_list = tokens.tolist()
        return token_list, (self._logprobs(logits, token_list, seqs) if want_logprobs else None)

    def constraints(self, seqs: list[Sequence], vocab_size: int) -> Constraints | None:
        """Host half of logit_bias and grammars; None (no work) when no row has either."""
        if not any(s.params.logit_bias or s.grammar is not None for s in seqs):
            return None
        rows, ids, values = [], [], []
        for i, seq in enumerate(seqs):
            for token, bias in (seq.params.logit_bias or {}).items():
                rows.append(i)
                ids.append(token)
                values.append(bias)
        mask_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        bitmask = None
        if mask_rows:
            words = -(-vocab_size // 32)
            host = self._bitmask_host
            if host is None or host.shape[0] < len(mask_rows) or host.shape[1] != words:
                rows_cap = max(len(mask_rows), host.shape[0] if host is not None else 0)
                host = torch.empty((rows_cap, words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
                self._bitmask_host = host
            bitmask = host[: len(mask_rows)]
            from kernellab.runtime.request import structured  # here: llguidance is needed only once a grammar is used

            structured.fill_bitmasks([s.grammar for s in seqs if s.grammar is not None], bitmask.numpy())
        return Constraints((rows, ids, values) if rows else None, mask_rows, bitmask)

    def _apply_constraints(self, logits: torch.Tensor, c: Constraints) -> None:
        dev = logits.device
        if c.bias is not None:
            rows, ids, values = c.bias
            index = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
            logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)
        if c.bitmask is not None:
            # The host buffer is rewritten next step only after this step's tokens came back (.tolist()), so the
            # asynchronous copy has finished by then.
            words = c.bitmask.to(dev, non_blocking=True)
            vocab = logits.shape[-1]
            allowed = ((words.unsqueeze(-1) >> self._bit_shifts) & 1).view(len(c.mask_rows), -1)[:, :vocab].bool()
            if len(c.mask_rows) == logits.shape[0]:
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                mask_rows = torch.tensor(c.mask_rows, device=dev)
                logits[mask_rows] = logits[mask_rows].masked_fill(~allowed, float("-inf"))

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        self._apply_penalties(logits, seqs)
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        greedy_rows = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        greedy_tokens = torch.argmax(logits, dim=-1)
        logits.div_(torch.where(greedy_rows, 1.0, temps).unsqueeze(1))
        probs = torch.softmax(logits, dim=-1)
        probs = self._filter(probs, seqs)
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                noise[i].fill_(1.0)
            elif p.seed is not None:
                noise[i].exponential_(generator=_row_generator(p.seed, seq.num_output_tokens, logits.device))
            else:
                noise[i].exponential_(generator=self.generator)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        sampled = torch.argmax(probs / noise, dim=-1)
        return torch.where(greedy_rows, greedy_tokens, sampled)

    @staticmethod
    def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        min_p = [s.params.min_p for s in seqs]
        if any(min_p):
            threshold = torch.tensor(min_p, device=probs.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        top_k = [s.params.top_k if s.params.top_k > 0 else probs.shape[-1] for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k < probs.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
            drop = ranks >= torch.tensor(top_k, device=probs.device).unsqueeze(1)
            cumulative = sorted_probs.cumsum(dim=-1) / sorted_probs.sum(dim=-1, keepdim=True)
            # Keep the smallest prefix whose mass reaches top_p; the first token always stays (top_p 0 keeps it alone).
            drop |= (
                (cumulative - sorted_probs / sorted_probs.sum(dim=-1, keepdim=True))
                >= torch.tensor(top_p, device=probs.device).unsqueeze(1)
            ) & (ranks > 0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        return probs

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            p = seq.params
            if not p.has_penalties:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device, dtype=torch.long)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if p.presence_penalty or p.frequency_penalty:
                out = seq.output_token_ids
                if out:
                    ids, counts = torch.tensor(out, device=logits.device).unique(return_counts=True)
                    row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], seqs: list[Sequence]) -> list[TokenLogprob]:
        return token_logprobs(raw, tokens, [s.params.logprobs or 0 for s in seqs])


def token_logprobs(raw: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """Row i's entry: ``tokens[i]``'s logprob under the raw logits ``raw[i]`` (log-softmax in fp32) and the top
    ``ks[i]`` there. Sampled tokens' logprobs and prompt logprobs (``ModelRunner._score_prompt``) both."""
    logp = torch.log_softmax(raw.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(ks, default=0)
    best = logp.topk(k, dim=-1) if k else None
    out = []
    for i, n in enumerate(ks):
        top = (
            list(zip(best.indices[i, :n].tolist(), best.values[i, :n].tolist(), strict=True))
            if best is not None and n
            else []
        )
        out.append(TokenLogprob(tokens[i], chosen[i], top))
    return out
