"""Picks each request's next token from its logits, vectorised over the batch.

First the logits of the rows that ask are edited, in this order: `logit_bias` added, the
penalties applied, and while `min_tokens` is unmet the request's EOS and stop tokens blocked.
Greedy rows then take the argmax; the others are sampled with temperature, top-k, top-p and
min-p by an exponential race (argmax of p / Exp(1) noise), which draws exactly from p. A request with a
seed draws its noise from a generator seeded by (seed, sample index, output position), so its
tokens do not depend on what else is in the batch, nor on preemption and recompute, and the n
samples of one prompt differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.model.kernels import cpu_kernels
from inflight.request import Request, TokenLogprobs

_SEED_STRIDE = 1_000_003
_SAMPLE_STRIDE = 7_919 * 65_537


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        # On CPU, the compiled argmax (`argmax_rows`): torch's took 2% of a 64-request decode step.
        kernels = cpu_kernels() if device.type == "cpu" else None
        self._argmax_rows = kernels.argmax_rows if kernels is not None else None

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a 2-D tensor: the first index of each row's largest value."""
        if self._argmax_rows is not None and x.dtype == torch.float32 and x.shape[-1] > 0:
            return self._argmax_rows(x)
        return x.argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        params = [r.sampling_params for r in requests]
        if any(p.edits_logits for p in params):
            logits = self._edit_logits(logits.clone(), requests)
        if all(p.is_greedy for p in params):
            return self._argmax(logits).tolist()

        greedy_tokens = self._argmax(logits)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        sub = logits[rows]
        temperature = torch.tensor([params[i].temperature for i in rows], device=self.device)
        sub = sub / temperature.unsqueeze(1)
        top_k = [params[i].top_k for i in rows]
        if any(top_k):
            sub = self._apply_top_k(sub, top_k)
        top_p = [params[i].top_p for i in rows]
        if any(p < 1 for p in top_p):
            sub = self._apply_top_p(sub, torch.tensor(top_p, device=self.device))
        probs = sub.softmax(dim=-1)
        min_p = [params[i].min_p for i in rows]
        if any(min_p):
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=self.device).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is None:
                noise[j].exponential_(generator=self._generator)
            else:
                g = torch.Generator(device=self.device)
                # The samples of one prompt (n > 1) draw apart: each its own stream.
                stream = seed * _SEED_STRIDE + requests[i].sample_index * _SAMPLE_STRIDE
                g.manual_seed((stream + requests[i].num_output_tokens) % (2**63))
                noise[j].exponential_(generator=g)
        sampled = self._argmax(probs / noise)
        greedy_tokens[rows] = sampled
        return greedy_tokens.tolist()

    @torch.inference_mode()
    def logprobs(self, logits: torch.Tensor, requests: Sequence[Request],
                 tokens: Sequence[int]) -> dict[str, TokenLogprobs]:
        """For the requests that ask: the chosen token's log-probability and the top ones, from
        the model's raw logits (the rows of the others are not touched)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return {}
        index = torch.tensor(rows, device=logits.device)
        k = max(requests[i].sampling_params.logprobs or 0 for i in rows)
        found = self.token_logprobs(logits.index_select(0, index), [tokens[i] for i in rows], k)
        out = {}
        for i, lp in zip(rows, found, strict=True):
            n = requests[i].sampling_params.logprobs or 0
            out[requests[i].request_id] = lp._replace(top=lp.top[:n])
        return out

    @torch.inference_mode()
    def token_logprobs(self, logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
        """Per row of `logits`: `tokens[row]`'s log-probability under its log-softmax, and the `k`
        most likely tokens'."""
        log_probs = logits.float().log_softmax(dim=-1)
        chosen = torch.tensor(list(tokens), device=logits.device)
        chosen_lp = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        if k:
            top_lp, top_ids = log_probs.topk(k, dim=-1)
            tops = [tuple(zip(ids, lps, strict=True)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist(),
                                                                          strict=True)]
        else:
            tops = [()] * len(chosen_lp)
        return [TokenLogprobs(t, lp, top) for t, lp, top in zip(tokens, chosen_lp, tops, strict=True)]

    def _edit_logits(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, request in enumerate(requests):
            p = request.sampling_params
            if not p.edits_logits:
                continue
            row = logits[i]
            if p.logit_bias:
                ids, bias = zip(*p.logit_bias, strict=True)
                row[torch.tensor(ids, device=self.device)] += torch.tensor(bias, dtype=row.dtype, device=self.device)
            if p.repetition_penalty != 1:
                seen = torch.tensor(sorted(set(request.all_token_ids)), device=self.device)
                seen = seen[seen < vocab]
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
                counts = torch.zeros(vocab, device=self.device)
                out = torch.tensor(request.output_token_ids, device=self.device)
                counts.scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
            if request.num_output_tokens < p.min_tokens:
                ends = [t for t in (*request.eos_token_ids, *p.stop_token_ids) if t < vocab]
                if ends:
                    row[torch.tensor(ends, device=self.device)] = float("-inf")
        return logits

    @staticmethod
    def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        vocab = logits.shape[1]
        k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=logits.device)
        top = logits.topk(int(k.max()), dim=-1).values
        threshold = top.gather(1, (k - 1).unsqueeze(1))
        return logits.masked_fill(logits < threshold, float("-inf"))

    @staticmethod
    def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
