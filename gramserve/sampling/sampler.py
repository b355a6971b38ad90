"""Batched sampling on the runner's device: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Every per-request knob becomes a column tensor so one batch is processed with a handful of tensor ops.
Random draws use the exponential-race trick (argmax of p / E with E ~ Exp(1)), which equals sampling from p
and lets seeded requests draw their noise from a hash of (seed, step, token) (seeded_noise.py): same seed, same
tokens, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gramserve.sampling.params import SamplingParams
from gramserve.sampling.seeded_noise import seeded_exponential


@dataclass
class SamplingRow:
    """What the sampler needs from one request at one step."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    suppress_ids: tuple[int, ...] = ()  # ids banned this step (EOS / stop ids before min_tokens)


NEG_INF = float("-inf")


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class PendingSample:
    """A sampling step launched on the device whose results have not been read yet.

    On CUDA the ids (and logprobs) are copied to pinned host memory without blocking, so the scheduler can
    prepare the next batch before `resolve` waits for this step's copy alone.
    """

    token_ids: torch.Tensor  # [B] int64, on the device: the next step's input ids are gathered from it
    logprobs: torch.Tensor | None = None  # [B]
    top_values: torch.Tensor | None = None  # [B, k]
    top_ids: torch.Tensor | None = None
    want_top: bool = False
    _host: list[torch.Tensor | None] | None = None
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        tensors = [self.token_ids, self.logprobs, self.top_values, self.top_ids]
        if self.token_ids.device.type != "cuda":
            self._host = tensors
            return
        self._host = [t.to("cpu", non_blocking=True) if t is not None else None for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record()

    def resolve(self) -> SampleResult:
        if self._host is None:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        ids, lp, top_v, top_i = self._host
        logprobs = lp.tolist() if lp is not None else None
        top = None
        if logprobs is not None:
            # Tokens a grammar mask, a ban or a -100 bias ruled out have logprob -inf: they are no alternative (and
            # -inf is not JSON), so a row may list fewer than the asked number.
            top = (
                [[(t, x) for t, x in zip(i, v) if x != NEG_INF] for i, v in zip(top_i.tolist(), top_v.tolist())]
                if self.want_top
                else [[] for _ in logprobs]
            )
        return SampleResult(ids.tolist(), logprobs, top)


TORCH_CHUNK_LOGITS = 1 << 24  # logits per chunk of the torch sampling path (64 MB a float32 temporary)


def _plain_greedy(r: SamplingRow) -> bool:
    return r.params.raw_argmax and not r.suppress_ids


def _edits_logits(r: SamplingRow) -> bool:
    """Whether this row's penalties, bias or banned ids change its logits in place."""
    return r.params.edits_logits or bool(r.suppress_ids)


class Sampler:
    def __init__(self, vocab_size: int, tokenizer_vocab_size: int, device: torch.device, backend: str = "torch"):
        self.vocab_size = vocab_size
        self.device = device
        # Logit columns past the tokenizer's vocabulary (padded embeddings) are never sampled.
        self.pad_columns = slice(tokenizer_vocab_size, vocab_size) if tokenizer_vocab_size < vocab_size else None
        if backend not in ("torch", "flashinfer"):  # `auto` is resolved by server/settings.py
            raise ValueError(f"unknown sampling backend {backend!r}")
        self.backend = backend
        self.kernels = None  # sort-free kernels for unseeded random rows (CUDA); None: the torch path for all
        if self.backend == "flashinfer":
            from gramserve.sampling.flashinfer_sampling import FlashInferSampling

            self.kernels = FlashInferSampling(device)
            self._warm_up()

    def _warm_up(self) -> None:
        """Build FlashInfer's sampling kernels now (a JIT compile on a fresh machine), not on a first request."""
        logits = torch.zeros(1, self.vocab_size, device=self.device)
        for top_p, top_k in ((0.9, 50), (0.9, -1), (1.0, 50), (1.0, -1)):  # each of the four kernel paths
            self.sample(logits, [SamplingRow(SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k), [], [])])

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], num_top_logprobs: int = -1) -> SampleResult:
        """logits: [B, V] float32. num_top_logprobs < 0 skips logprob computation."""
        return self.launch(logits, rows, num_top_logprobs).resolve()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow], num_top_logprobs: int = -1) -> PendingSample:
        """Queue the sampling ops and the copy of their results to the host; nothing here waits for the device."""
        pending = self._launch(logits, rows, num_top_logprobs)
        pending.start_copy()
        return pending

    def launch_greedy(self, logits: torch.Tensor) -> PendingSample:
        """`launch` for a batch whose every row is plain greedy (no penalties, bias, bans or logprobs), with no
        per-row work."""
        pending = self._argmax(logits)
        pending.start_copy()
        return pending

    def _argmax(self, logits: torch.Tensor) -> PendingSample:
        # The common serving case: one argmax over the real vocabulary and one copy of the ids to the host.
        width = self.pad_columns.start if self.pad_columns is not None else logits.shape[-1]
        return PendingSample(logits[:, :width].argmax(dim=-1))

    def _launch(self, logits: torch.Tensor, rows: list[SamplingRow], num_top_logprobs: int) -> PendingSample:
        if num_top_logprobs < 0 and all(_plain_greedy(r) for r in rows):
            return self._argmax(logits)
        if self.pad_columns is not None or any(_edits_logits(r) for r in rows):
            logits = logits.clone()  # the caller's logits stay as they were
        if self.pad_columns is not None:
            logits[:, self.pad_columns] = float("-inf")
        self._apply_penalties(logits, rows)
        self._apply_bias_and_bans(logits, rows)

        if num_top_logprobs >= 0:
            logp_all = torch.log_softmax(logits, dim=-1)

        temps = [r.params.temperature for r in rows]
        if all(r.params.greedy for r in rows):
            next_ids = logits.argmax(dim=-1)
        else:
            greedy = [r.params.greedy for r in rows]
            next_ids = self._sample_random(logits, rows, temps)
            if any(greedy):
                next_ids = torch.where(self._column(greedy, torch.bool), logits.argmax(dim=-1), next_ids)

        pending = PendingSample(next_ids)
        if num_top_logprobs >= 0:
            pending.logprobs = logp_all.gather(1, next_ids[:, None])[:, 0]
            if num_top_logprobs > 0:
                pending.top_values, pending.top_ids = logp_all.topk(num_top_logprobs, dim=-1)
                pending.want_top = True
        return pending

    def _column(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A per-request column on the device; non_blocking so the host does not wait for queued kernels."""
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        need = [
            i
            for i, r in enumerate(rows)
            if r.params.frequency_penalty or r.params.presence_penalty or r.params.repetition_penalty != 1.0
        ]
        if not need:
            return
        for i in need:
            p = rows[i].params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = self._column(sorted(set(rows[i].prompt_ids) | set(rows[i].output_ids)), torch.long)
                if seen.numel():
                    vals = row[seen]
                    row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and rows[i].output_ids:
                out = self._column(rows[i].output_ids, torch.long)
                counts = torch.zeros(self.vocab_size, dtype=logits.dtype, device=self.device)
                counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
                row -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty

    def _apply_bias_and_bans(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                ids = self._column(list(r.params.logit_bias.keys()), torch.long)
                vals = self._column(list(r.params.logit_bias.values()), logits.dtype)
                logits[i, ids] += vals
            if r.suppress_ids:
                logits[i, self._column(list(r.suppress_ids), torch.long)] = float("-inf")

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float]) -> torch.Tensor:
        """A draw for every row (greedy rows' draws are replaced by the caller)."""
        if self.kernels is None:
            return self._sample_torch(logits, rows, temps)
        return self._sample_kernels(logits, rows, temps)

    def _sample_kernels(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float]) -> torch.Tensor:
        """Unseeded random rows through the sort-free kernels; seeded and min_p rows through the torch path."""
        own = [
            i for i, r in enumerate(rows) if not r.params.greedy and (r.params.seed is not None or r.params.min_p > 0)
        ]
        if len(own) == len(rows):
            return self._sample_torch(logits, rows, temps)
        # Greedy rows take the argmax afterwards; temperature 1 keeps their softmax finite meanwhile.
        t = self._column([x if x > 0 else 1.0 for x in temps], torch.float32)
        top_k = [r.params.top_k if 0 < r.params.top_k < self.vocab_size else self.vocab_size for r in rows]
        top_p = [r.params.top_p for r in rows]
        sampled = self.kernels.sample(
            logits,
            t,
            self._column(top_k, torch.int32) if any(k < self.vocab_size for k in top_k) else None,
            self._column(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
        )
        if own:
            idx = self._column(own, torch.long)
            sampled[idx] = self._sample_torch(logits[idx], [rows[i] for i in own], [temps[i] for i in own])
        return sampled

    def _sample_torch(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float]) -> torch.Tensor:
        """In row chunks: a top-k / top-p sort makes several [rows, vocab] temporaries (about 30 bytes a logit),
        which for a thousand rows of a 128k vocabulary would not fit beside a full GPU's KV pool."""
        step = max(1, TORCH_CHUNK_LOGITS // logits.shape[-1])
        if len(rows) <= step:
            return self._sample_torch_rows(logits, rows, temps)
        return torch.cat(
            [
                self._sample_torch_rows(logits[i : i + step], rows[i : i + step], temps[i : i + step])
                for i in range(0, len(rows), step)
            ]
        )

    def _sample_torch_rows(self, logits: torch.Tensor, rows: list[SamplingRow], temps: list[float]) -> torch.Tensor:
        t = self._column([max(x, 1e-5) for x in temps], logits.dtype)
        probs = torch.softmax(logits / t[:, None], dim=-1)
        probs = self._filter(probs, rows)
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        if not seeded:
            return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        # A function of (seed, step, token): the same tokens whatever the batch, row or device (seeded_noise.py).
        drawn = seeded_exponential(
            [rows[i].params.seed for i in seeded],
            [len(rows[i].output_ids) for i in seeded],
            probs.shape[-1],
            probs.device,
        ).to(probs.dtype)
        if len(seeded) == len(rows):
            return (probs / drawn).argmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        noise[self._column(seeded, torch.long)] = drawn
        return (probs / noise).argmax(dim=-1)

    def _filter(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        top_k = [r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in rows]
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if any(k < self.vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=self.device)[None, :]
            k = self._column(top_k, torch.long)[:, None]
            cum_before = sorted_p.cumsum(dim=-1) - sorted_p
            p = self._column(top_p, probs.dtype)[:, None]
            drop = (ranks >= k) | (cum_before > p)
            drop[:, 0] = False  # always keep the most likely token
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if any(m > 0 for m in min_p):
            m = self._column(min_p, probs.dtype)[:, None]
            probs = probs.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * m, 0.0)
        return probs
