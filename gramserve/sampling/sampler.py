"""Batched sampling on the runner's device: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Every per-request knob becomes a column tensor so one batch is processed with a handful of tensor ops.
Random draws use the exponential-race trick (argmax of p / E with E ~ Exp(1)), which equals sampling from p
and lets seeded requests draw their noise from their own generator: same seed, same tokens, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gramserve.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs from one request at one step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # set for seeded requests
    suppress_ids: tuple[int, ...] = ()  # ids banned this step (EOS / stop ids before min_tokens)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token
    top_logprobs: list[list[tuple[int, float]]] | None


def _plain_greedy(r: SamplingRow) -> bool:
    p = r.params
    return (p.greedy and not r.suppress_ids and not p.logit_bias and not p.frequency_penalty
            and not p.presence_penalty and p.repetition_penalty == 1.0)


class Sampler:
    def __init__(self, vocab_size: int, tokenizer_vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        # Logit columns past the tokenizer's vocabulary (padded embeddings) are never sampled.
        self.pad_columns = slice(tokenizer_vocab_size, vocab_size) if tokenizer_vocab_size < vocab_size else None

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], num_top_logprobs: int = -1) -> SampleResult:
        """logits: [B, V] float32. num_top_logprobs < 0 skips logprob computation."""
        if num_top_logprobs < 0 and all(_plain_greedy(r) for r in rows):
            # The common serving case: one argmax over the real vocabulary and one copy of the ids to the host.
            width = self.pad_columns.start if self.pad_columns is not None else logits.shape[-1]
            return SampleResult(logits[:, :width].argmax(dim=-1).tolist(), None, None)
        logits = logits.clone()
        if self.pad_columns is not None:
            logits[:, self.pad_columns] = float("-inf")
        self._apply_penalties(logits, rows)
        self._apply_bias_and_bans(logits, rows)

        logprobs = top = None
        if num_top_logprobs >= 0:
            logp_all = torch.log_softmax(logits, dim=-1)

        temps = [r.params.temperature for r in rows]
        greedy = torch.tensor([r.params.greedy for r in rows], device=self.device)
        if all(r.params.greedy for r in rows):
            next_ids = logits.argmax(dim=-1)
        else:
            next_ids = self._sample_random(logits, rows, temps, greedy)

        if num_top_logprobs >= 0:
            chosen = logp_all.gather(1, next_ids[:, None])[:, 0]
            logprobs = chosen.tolist()
            if num_top_logprobs > 0:
                vals, idx = logp_all.topk(num_top_logprobs, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
            else:
                top = [[] for _ in rows]
        return SampleResult(next_ids.tolist(), logprobs, top)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        need = [i for i, r in enumerate(rows)
                if r.params.frequency_penalty or r.params.presence_penalty or r.params.repetition_penalty != 1.0]
        if not need:
            return
        for i in need:
            p = rows[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(rows[i].prompt_ids) | set(rows[i].output_ids)),
                                    dtype=torch.long, device=self.device)
                if seen.numel():
                    vals = row[seen]
                    row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and rows[i].output_ids:
                out = torch.tensor(rows[i].output_ids, dtype=torch.long, device=self.device)
                counts = torch.zeros(self.vocab_size, dtype=logits.dtype, device=self.device)
                counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
                row -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty

    def _apply_bias_and_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids = torch.tensor(list(r.params.logit_bias.keys()), dtype=torch.long, device=self.device)
                vals = torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype, device=self.device)
                logits[i, ids] += vals
            if r.suppress_ids:
                logits[i, list(r.suppress_ids)] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float],
                       greedy: torch.Tensor) -> torch.Tensor:
        t = torch.tensor([max(x, 1e-5) for x in temps], dtype=logits.dtype, device=self.device)
        probs = torch.softmax(logits / t[:, None], dim=-1)
        probs = self._filter(probs, rows)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None:
                # Seeded noise is drawn on the CPU (where the request's generator lives), so a seed gives
                # the same tokens on every device.
                noise[i] = torch.empty(probs.shape[-1]).exponential_(generator=r.generator).to(noise.device)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _filter(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        top_k = [r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k < self.vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=self.device)[None, :]
            k = torch.tensor(top_k, device=self.device)[:, None]
            cum_before = sorted_p.cumsum(dim=-1) - sorted_p
            p = torch.tensor(top_p, dtype=probs.dtype, device=self.device)[:, None]
            drop = (ranks >= k) | (cum_before > p)
            drop[:, 0] = False  # always keep the most likely token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if any(m > 0 for m in min_p):
            m = torch.tensor(min_p, dtype=probs.dtype, device=self.device)[:, None]
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * m, 0.0)
        return probs
