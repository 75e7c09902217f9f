"""Picks each request's next token from its logits, vectorised over the batch.

First the logits of the rows that ask are edited, in this order: `logit_bias` added, the
penalties applied, while `min_tokens` is unmet the request's EOS and stop tokens blocked, and
with structured output every token its grammar disallows blocked. Greedy rows then take the
argmax; the others are sampled with temperature, top-k, top-p and min-p, drawn exactly from
the resulting p by inverse transform (one uniform number per row). A request with a seed draws
its number from a generator seeded by (seed, sample index, output position), so its tokens do
not depend on what else is in the batch, nor on preemption and recompute, nor on the proposals
it verifies (`sample`), and the n samples of one prompt differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.engine.structured import TokenMasks
from inflight.model.kernels import cpu_kernels
from inflight.request import Grammar, Request, SamplingParams, TokenLogprobs

_SEED_STRIDE = 1_000_003
_NUCLEUS_CANDIDATES = 256
_SAMPLE_STRIDE = 7_919 * 65_537


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        # On CPU, the compiled argmax (`argmax_rows`): torch's took 2% of a 64-request decode step.
        kernels = cpu_kernels() if device.type == "cpu" else None
        self._argmax_rows = kernels.argmax_rows if kernels is not None else None
        self._token_masks: TokenMasks | None = None  # made for the first constrained row

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) of a 2-D tensor: the first index of each row's largest value."""
        if self._argmax_rows is not None and x.dtype == torch.float32 and x.shape[-1] > 0:
            return self._argmax_rows(x)
        return x.argmax(dim=-1)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per row of `logits`, the row of `requests[i]` at i."""
        params = [r.sampling_params for r in requests]
        logits = self._edited(logits, requests)
        if all(p.is_greedy for p in params):
            return self._argmax(logits).tolist()

        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        tokens = torch.zeros(len(requests), dtype=torch.long, device=self.device)
        if greedy:
            index = torch.tensor(greedy, device=self.device)
            tokens[index] = self._argmax(logits.index_select(0, index))
        probs = self._probs(logits[rows] if greedy else logits, [params[i] for i in rows])
        tokens[torch.tensor(rows, device=self.device)] = self._draw(probs, [requests[i] for i in rows])
        return tokens.tolist()

    def _edited(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The logits with each request's edits and grammar mask, a copy if any applies."""
        edits = any(r.sampling_params.edits_logits for r in requests)
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.constrains]
        if edits or constrained:
            logits = logits.clone()
            if edits:
                self._edit_logits(logits, requests)
            if constrained:
                self._mask(logits, constrained, [gr for i in constrained if (gr := requests[i].grammar) is not None])
        return logits

    def _probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Each sampled row's distribution, unnormalized: temperature, top-k, top-p, then min-p."""
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        sub = logits / temperature.unsqueeze(1)
        # Only a repetition-penalised row (its seen tokens' logits may sit at the dtype's largest
        # value) or a temperature past fp32's range (inf: -inf / inf is NaN) can overflow here;
        # other batches skip the extra pass.
        if any(p.repetition_penalty != 1 or p.temperature > _FP32_MAX for p in params):
            _bounded_(sub)
        top_k = [p.top_k for p in params]
        if any(top_k):
            sub = self._apply_top_k(sub, top_k)
        top_p = [p.top_p for p in params]
        if any(p < 1 for p in top_p):
            sub = self._apply_top_p(sub, torch.tensor(top_p, device=self.device))
        probs = sub.softmax(dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=self.device).unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    # --- speculative decoding -------------------------------------------------------------------

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[Request],
               drafts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each request's new tokens. Request i has 1 + len(drafts[i]) consecutive rows: its last
        known token's, then each proposed token's. Proposed tokens are kept in order while the
        model agrees, then one token of the model's own follows (the correction, or after every
        proposal kept, the next one): greedy rows keep a proposal equal to their argmax, so the
        tokens are those of decoding one at a time; sampled rows draw their token from p as a
        step without proposals would (the same uniform), and keep proposal x where the draw is x:
        with probability p(x), as rejection sampling against a draft certain of x keeps it, every
        token distributed as p, and a seeded request's tokens those it gets without speculation,
        whatever was proposed and whoever shared its steps. Every row sees the edits, penalties
        and grammar of the tokens before it."""
        if not any(drafts):
            return [[t] for t in self(logits, requests)]
        starts, row = [], 0
        for draft in drafts:
            starts.append(row)
            row += 1 + len(draft)
        out: list[list[int]] = [[] for _ in requests]
        plain = [i for i, d in enumerate(drafts) if not d]
        if plain:
            index = torch.tensor([starts[i] for i in plain], device=self.device)
            for i, token in zip(plain, self(logits.index_select(0, index), [requests[i] for i in plain]), strict=True):
                out[i] = [token]
        argmax_only = [i for i, (r, d) in enumerate(zip(requests, drafts, strict=True))
                       if d and r.sampling_params.is_greedy and not r.sampling_params.edits_logits
                       and r.grammar is None]
        if argmax_only:
            index = torch.tensor([starts[i] + j for i in argmax_only for j in range(1 + len(drafts[i]))],
                                 device=self.device)
            best = self._argmax(logits.index_select(0, index)).tolist()
            at = 0
            for i in argmax_only:
                out[i] = self.kept_greedy(drafts[i], best[at:at + 1 + len(drafts[i])])
                at += 1 + len(drafts[i])
        done = set(plain) | set(argmax_only)
        for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
            if i not in done:
                out[i] = self._verify(logits[starts[i]:starts[i] + 1 + len(draft)], request, list(draft))
        return out

    @staticmethod
    def argmax_only(request: Request) -> bool:
        """Whether a request's tokens are its logits' argmax and nothing more: greedy, no edits to
        its logits, no grammar, no logprobs (the model's greedy head may then choose them)."""
        params = request.sampling_params
        return (params.is_greedy and not params.edits_logits and request.grammar is None
                and params.logprobs is None)

    @staticmethod
    def kept_greedy(draft: Sequence[int], choices: Sequence[int]) -> list[int]:
        """A greedy request's new tokens from the argmax of each of its rows (`choices`, 1 +
        len(draft)): the proposed tokens while they equal the argmax, then the argmax."""
        kept = 0
        while kept < len(draft) and draft[kept] == choices[kept]:
            kept += 1
        return [*draft[:kept], choices[kept]]

    def _verify(self, rows: torch.Tensor, request: Request, draft: list[int]) -> list[int]:
        """One request's rows, position by position, each seeing the proposed tokens kept before
        it as the request's own (appended to its output and grammar meanwhile, then taken back)."""
        tokens: list[int] = []
        kept = 0
        try:
            for j in range(len(draft) + 1):
                proposed = draft[j] if j < len(draft) else None
                token = self._verify_row(rows[j:j + 1], request)
                tokens.append(token)
                if token != proposed:
                    break
                request.output_token_ids.append(token)
                kept += 1
                if request.grammar is not None and not request.grammar.accept(token):
                    break  # proposals were cut to what the grammar allows: not reached
        finally:
            del request.output_token_ids[len(request.output_token_ids) - kept:]
            if request.grammar is not None:
                request.grammar.rollback(kept)
        return tokens

    def _verify_row(self, row: torch.Tensor, request: Request) -> int:
        """The row's token, drawn as a step without proposals draws it (a seeded request's
        uniform keyed by its output position, which counts the proposals kept before the row):
        the caller keeps the proposal where the draw is it."""
        params = request.sampling_params
        edited = self._edited(row, [request])
        if params.is_greedy:
            return int(self._argmax(edited)[0])
        return int(self._draw(self._probs(edited, [params]), [request])[0])

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row of `probs`, drawn exactly from that row by inverse transform: the
        first token whose cumulative probability exceeds u times the row's total, u uniform in
        [0, 1) from the request's own generator if it has a seed. One uniform per row: an
        exponential race (a noise value per token) cost 1.5 ms a row on a CPU, this 0.04."""
        u = torch.empty(len(requests), 1, device=self.device)
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, generator=self._generator, device=self.device)
        for j, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None:
                g = torch.Generator(device=self.device)
                # The samples of one prompt (n > 1) draw apart: each its own stream.
                stream = seed * _SEED_STRIDE + request.sample_index * _SAMPLE_STRIDE
                g.manual_seed((stream + request.num_output_tokens) % (2**63))
                u[j] = torch.rand(1, generator=g, device=self.device)
        cdf = probs.cumsum(dim=-1)
        # right=True: a token of probability 0 adds nothing to the sum, so it is never the first to exceed it.
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        over = drawn >= probs.shape[1]  # u times the total rounded up to the total: take the last possible token
        if bool(over.any()):
            last = probs.shape[1] - 1 - (probs.flip(1) > 0).int().argmax(dim=1)
            drawn = torch.where(over, last, drawn)
        return drawn

    @torch.inference_mode()
    def logprobs(self, logits: torch.Tensor, requests: Sequence[Request], tokens: Sequence[Sequence[int]],
                 drafts: Sequence[Sequence[int]] | None = None) -> dict[str, list[TokenLogprobs]]:
        """For the requests that ask: each new token's log-probability and the top ones, from the
        model's raw logits (the rows of the others are not touched). Rows as `sample` lays them
        out: 1 + len(drafts[i]) for request i, its j-th new token from its j-th row."""
        asking = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not asking:
            return {}
        starts, row = [], 0
        for i in range(len(requests)):
            starts.append(row)
            row += 1 + (len(drafts[i]) if drafts is not None else 0)
        rows = [(i, starts[i] + j, t) for i in asking for j, t in enumerate(tokens[i])]
        index = torch.tensor([r for _, r, _ in rows], device=logits.device)
        k = max(requests[i].sampling_params.logprobs or 0 for i in asking)
        found = self.token_logprobs(logits.index_select(0, index), [t for _, _, t in rows], k)
        out: dict[str, list[TokenLogprobs]] = {}
        for (i, _, _), lp in zip(rows, found, strict=True):
            request = requests[i]
            top = lp.top[:request.sampling_params.logprobs or 0]
            out.setdefault(request.request_id, []).append(lp._replace(top=top))
        return out

    @torch.inference_mode()
    def token_logprobs(self, logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
        """Per row of `logits`: `tokens[row]`'s log-probability under its log-softmax, its rank, and
        the `k` most likely tokens'."""
        log_probs = logits.float().log_softmax(dim=-1)
        chosen = torch.tensor(list(tokens), device=logits.device)
        chosen_column = log_probs.gather(1, chosen.unsqueeze(1))
        ranks = ((log_probs > chosen_column).sum(dim=-1) + 1).tolist()
        chosen_lp = chosen_column.squeeze(1).tolist()
        if k:
            top_lp, top_ids = log_probs.topk(k, dim=-1)
            tops = [tuple(zip(ids, lps, strict=True)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist(),
                                                                          strict=True)]
        else:
            tops = [()] * len(chosen_lp)
        return [TokenLogprobs(t, lp, top, rank)
                for t, lp, top, rank in zip(tokens, chosen_lp, tops, ranks, strict=True)]

    def _mask(self, logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> None:
        if self._token_masks is None:
            self._token_masks = TokenMasks(self.device)
        self._token_masks.apply(logits, rows, grammars)

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
                # The one edit that can overflow: bounded here, before the grammar's mask.
                row[seen] = _bounded_(torch.where(values > 0, values / p.repetition_penalty,
                                                  values * p.repetition_penalty))
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
        """Keeps each row's nucleus: its most likely tokens until they reach top_p (a token is
        dropped when the tokens ranked above it already do; the first always stays). Found among
        the row's `_NUCLEUS_CANDIDATES` most likely tokens when those already reach top_p without
        the last of them (nearly always: a full sort of a 49k vocabulary costs 8x a top-256), else
        by sorting the whole row; the two give the same nucleus."""
        k = min(_NUCLEUS_CANDIDATES, logits.shape[1])
        probs = logits.softmax(dim=-1)
        top_probs, top_ids = probs.topk(k, dim=-1)
        mass_above = top_probs.cumsum(dim=-1) - top_probs
        threshold = top_p.unsqueeze(1)
        out = torch.full_like(logits, float("-inf"))
        keep = mass_above < threshold
        keep[:, 0] = True  # also where top_p is below fp32's smallest value (1e-300 sent: 0 here)
        kept = torch.where(keep, logits.gather(1, top_ids), float("-inf"))
        out.scatter_(1, top_ids, kept)
        # Rows whose last candidate is still kept may keep tokens beyond the candidates: sort those.
        uncovered = (mass_above[:, -1] < top_p).nonzero().squeeze(1)
        if uncovered.numel() and k < logits.shape[1]:
            out[uncovered] = Sampler._nucleus_by_sort(logits[uncovered], top_p[uncovered])
        return out

    @staticmethod
    def _nucleus_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)


_FP32_MAX = float(torch.finfo(torch.float32).max)


def _bounded_(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf to the dtype's largest value, NaN to -inf. A repetition penalty or a
    temperature at the ends of its range overflows in fp32 (a penalty of 5e-324 is 0 there, and a
    seen token's positive logit over it +inf; one of 1e308 is inf, and a zero logit times it NaN;
    a temperature of 1e300 is inf, and a masked logit over it NaN), and one +inf or NaN makes the
    softmax NaN, whose draw can land on any token, one the grammar forbids included."""
    return logits.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))
