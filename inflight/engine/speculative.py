"""Speculative decoding's proposals and how many of them each step verifies. Pure Python.

A running request whose next step would compute one token may instead compute that token and
up to k proposed ones in the same step; the model's distribution at each position decides how
many of them it keeps (the sampler's `sample`), and the request grows by those and one more
token of its own. The proposals are free to make (n-gram lookup in the request's own tokens);
what they cost is the step's time, which grows with every extra token it computes.

So each step the `Speculator` chooses each request's length: extra tokens are taken, most likely
to be accepted first, as many as give the batch the most expected tokens per second of step
time. The chance that a request's first proposed token is kept is its own rate so far, with as
prior the rate of drafts that follow a match of the same length (an n-gram's n, a suffix's
depth: a long match is kept far more often than a short one), which has the whole engine's as
its own; each later token's, the chance that it is kept once the one before it was, measured on
such drafts by position. The step's time is the step-time predictor's (the roofline cost model
refitted online to the engine's own steps, as the SLO policy uses it). At one request a step
reads every weight for one token or for several, and the extra tokens cost only their
arithmetic: on 2 Zen 4 cores a 5-token step of the embedded model takes 1.5x a 1-token one in
fp32, so a step verifying four proposed tokens, three of them kept, makes 4 tokens in the time
of 1.5. At saturation every token costs its share of a compute-bound step, a proposal's expected
gain of less than one token loses, and speculation falls to zero by itself, without a load
threshold.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inflight.config import SpeculativeConfig
from inflight.perf.cost_model import SeqWork, StepTimeModel
from inflight.request import Request

# A request's acceptance counts fade by this factor at each verifying step (and at each step it
# had a proposal but verified none), so its estimate follows its recent text and, unused, drifts
# back to the engine-wide rate, which lets it try again.
_FADE = 0.8
# The engine-wide rates count as this many proposals of a request's own.
_PRIOR_PROPOSALS = 2.0
# Before anything is measured: the chance assumed that a proposed token is kept.
_INITIAL_RATE = 0.5
# The engine-wide counts of drafts judged and first tokens kept fade by this factor at each judged
# draft (they follow the last fifty or so), and at each step that verified none of the proposals
# it could have: an estimate that keeps proposals out is not tested by them, so it drifts back
# towards `_INITIAL_RATE` until one is verified and measured again. Without this, a few rejected
# drafts (sampled requests at a high temperature, say) ended speculation for the engine's life:
# nothing verified, nothing learned. Recovering from eight rejected drafts takes about 60 such
# steps; a probe that fails again costs one step part of a token's verification.
_ENGINE_FADE = 0.98
# Measured / predicted step time: the median of this many recent steps of each size class.
_HISTORY = 32
# A size class not measured in this many steps is forgotten: it borrows the nearest measured
# class's ratio again, so a step length once judged too slow (perhaps from a step or two slowed
# by something else) is tried and measured again instead of never again.
_STALE_STEPS = 64


def _size_class(num_tokens: int) -> int:
    """Steps of 1, 2, 3-4, 5-8, 9-16, ... tokens: one correction of the cost model each."""
    return max(0, num_tokens - 1).bit_length()


class StepCurve:
    """A step's time from its work: the cost model's prediction, times the ratio measured on this
    engine's own recent steps of the same size class. The cost model alone misjudges how a step's
    time grows with its tokens where the kernels change with the row count (a GGUF's blocks are
    read in registers up to a few rows, in fp32 panels past them: on a 2-core CPU a 5-token step of
    the embedded model takes 1.5x a 1-token one, where the cost model says 1.1x). A class not
    yet measured, or not for `_STALE_STEPS` steps, takes the nearest measured one's ratio, so a
    longer step is tried and then known, and tried again now and then."""

    def __init__(self, cost_model: StepTimeModel) -> None:
        self.cost_model = cost_model
        self._ratios: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # size class -> the median of its ratios, kept with them
        self._last_seen: dict[int, int] = {}  # size class -> the step that last measured it
        self._num_steps = 0

    def __call__(self, batch: Sequence[SeqWork]) -> float:
        return self.cost_model.step_time(batch) * self.correction(sum(w.num_new_tokens for w in batch))

    def correction(self, num_tokens: int) -> float:
        medians = self._medians
        if not medians:
            return 1.0
        size = _size_class(num_tokens)
        if size in medians:
            return medians[size]
        return medians[min(medians, key=lambda c: (abs(c - size), c))]

    def observe(self, batch: Sequence[SeqWork], measured_s: float) -> None:
        predicted = self.cost_model.step_time(batch)
        if predicted > 0 and measured_s > 0 and batch:
            self._num_steps += 1
            size = _size_class(sum(w.num_new_tokens for w in batch))
            ratios = self._ratios.setdefault(size, deque(maxlen=_HISTORY))
            ratios.append(min(10.0, max(0.1, measured_s / predicted)))
            self._medians[size] = statistics.median(ratios)
            self._last_seen[size] = self._num_steps
            for stale in [c for c, seen in self._last_seen.items() if self._num_steps - seen >= _STALE_STEPS]:
                del self._ratios[stale], self._medians[stale], self._last_seen[stale]


class NgramIndex:
    """One request's tokens, indexed so that the latest earlier occurrence of each n-gram (n from
    `min_n` to `max_n`) is found in one lookup; kept up to date as the request grows."""

    __slots__ = ("max_n", "min_n", "_ends", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n -> hash of an n-gram -> the latest position just after an earlier occurrence of it. By
        # hash, not the tuple (a third of the memory): a collision only proposes tokens that the
        # model then rejects.
        self._ends: dict[int, dict[int, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # occurrences ending before this position are in `_ends`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        ending `tokens` (tokens[-n:]); none if no such n-gram occurred before."""
        return self.lookup(tokens, k)[1]

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[int, list[int]]:
        """`propose`'s tokens and the n of the n-gram they follow (0 where none is found)."""
        size = len(tokens)
        # Index every occurrence that ends before the last token (so its successor is known).
        for end in range(max(self._indexed, self.min_n), size):
            for n, ends in self._ends.items():
                if n <= end:
                    ends[hash(tuple(tokens[end - n:end]))] = end
        self._indexed = max(self._indexed, size)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            found = self._ends[n].get(hash(tuple(tokens[size - n:])))
            if found is not None:
                return n, list(tokens[found:found + k])
        return 0, []


# The context lengths a suffix index tracks (those up to its depth, and the depth itself): a
# match is found at the longest of them, at a fraction of a full suffix tree's memory.
_SUFFIX_DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class SuffixIndex:
    """For every context of tracked length seen in some token sequences, how often each token
    followed it (suffix decoding's statistics, kept by hash). Sequences are added as they grow
    (`extend`) and may be taken out again (`remove`: the cache of past requests forgets its oldest)."""

    __slots__ = ("depths", "_next")

    def __init__(self, max_depth: int) -> None:
        self.depths = tuple(sorted({d for d in _SUFFIX_DEPTHS if d < max_depth} | {max_depth}))
        self._next: dict[int, dict[int, int]] = {}  # hash of a context -> next token -> count

    def extend(self, tokens: Sequence[int], start: int, end: int, sign: int = 1) -> None:
        """Counts each token at positions start..end - 1 after each tracked context before it."""
        table = self._next
        for position in range(max(start, 1), end):
            token = tokens[position]
            for depth in self.depths:
                if depth > position:
                    break
                key = hash(tuple(tokens[position - depth:position]))
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                left = counts.get(token, 0) + sign
                if left > 0:
                    counts[token] = left
                else:
                    counts.pop(token, None)
                    if not counts:
                        del table[key]

    def remove(self, tokens: Sequence[int]) -> None:
        self.extend(tokens, 0, len(tokens), sign=-1)

    def longest(self, context: Sequence[int]) -> tuple[int, dict[int, int] | None]:
        """The longest tracked suffix of `context` seen followed by something: (its length, the
        counts of what followed), or (0, None)."""
        for depth in reversed(self.depths):
            if depth <= len(context):
                counts = self._next.get(hash(tuple(context[len(context) - depth:])))
                if counts:
                    return depth, counts
        return 0, None


class Drafter(Protocol):
    """A proposer that costs time (a draft model): asked for the lengths chosen, after choosing."""

    def propose(self, wanted: dict[Request, int]) -> dict[Request, list[int]]:
        """Up to `wanted[r]` proposed tokens of each request (none for some, where it cannot)."""
        ...

    def cost(self, lengths: Sequence[tuple[Request, int]]) -> float:
        """Predicted seconds to propose `lengths` tokens of each request."""
        ...

    def forget(self, request_id: str) -> None:
        """The request has finished: what the drafter holds of it goes."""
        ...

    @property
    def last_s(self) -> float:
        """Seconds the last `propose` took."""
        ...


def draft_passes(lengths: Sequence[tuple[Request, int]], catch_up: Callable[[Request], int]) -> list[list[SeqWork]]:
    """A draft model's forward passes that propose `lengths` tokens of each request: the first
    computes each request's `catch_up(request)` tokens the draft does not hold yet (its latest
    last) and so proposes one token; each further pass, one more token of each request still short."""
    rounds = max((n for _, n in lengths), default=0)
    return [[SeqWork(catch_up(r) if j == 0 else 1, r.num_tokens + j, 1) for r, n in lengths if n > j]
            for j in range(rounds)]


@dataclass(slots=True)
class SpecStats:
    """Counters of the proposals verified (vLLM's spec_decode metrics): how many requests in how
    many steps proposed (drafts), how many tokens they proposed, how many the model kept, and of
    those by position (the i-th proposed token of a draft kept)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Lookups of a decoding request's proposals in its own tokens (n-gram, suffix; a draft model's
    # are not lookups), and of those the ones that found any: where the text stops repeating itself
    # none is found, and the step decodes one token (the simulator's `proposal_rate`).
    num_lookups: int = 0
    num_found: int = 0
    # Wall seconds the scheduler spent on speculation outside the model: choosing lengths, looking
    # up proposals, recording what was kept (a draft model's passes not included: `draft_s`).
    overhead_s: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a drafting request gains per verifying step: the accepted ones and its own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class _StepRates:
    """The step that verifies the first m of a list of candidate tokens (their chances, most
    likely first, and their requests' indexes), as a function of m: its expected tokens
    (`tokens`), its predicted seconds (`seconds`, each m's computed once) and their ratio, its
    expected tokens per second (called). A drafter's time to propose them counts in the step's."""

    def __init__(self, curve: StepCurve, drafter: Drafter | None, candidates: list[tuple[float, int]],
                 requests: list[Request], batch: Sequence[SeqWork]) -> None:
        self.curve, self.drafter = curve, drafter
        self.candidates, self.requests, self.batch = candidates, requests, batch
        self.base_tokens = sum(1 for w in batch if w.samples)
        self.cumulative = [0.0]
        for chance, _ in candidates:
            self.cumulative.append(self.cumulative[-1] + chance)
        self._seconds: dict[int, float] = {}

    def tokens(self, m: int) -> float:
        return self.base_tokens + self.cumulative[m]

    def seconds(self, m: int) -> float:
        known = self._seconds.get(m)
        if known is not None:
            return known
        requests, batch = self.requests, self.batch
        extra = [0] * len(requests)
        for _, i in self.candidates[:m]:
            extra[i] += 1
        work = [SeqWork(w.num_new_tokens + extra[i], w.context_len + extra[i], w.samples + extra[i])
                if i < len(requests) else w for i, w in enumerate(batch)]
        seconds = self.curve(work)
        if self.drafter is not None and m:
            seconds += self.drafter.cost([(r, n) for r, n in zip(requests, extra, strict=True) if n])
        self._seconds[m] = seconds
        return seconds

    def __call__(self, m: int) -> float:
        return self.tokens(m) / self.seconds(m)


class Speculator:
    """Proposes each decoding request's next tokens and chooses how many of them each step verifies
    (`lengths`); learns what the model keeps (`observe`) and what steps cost (`observe_step`)."""

    def __init__(self, config: SpeculativeConfig, cost_model: StepTimeModel | None,
                 proposer: Callable[[Request, int], list[int]] | None = None) -> None:
        """`cost_model`: a step's predicted seconds from its work (None with `adaptive` off).
        `proposer`: up to k proposed tokens of a request, instead of the configured method's
        (the simulator's, whose token ids stand for nothing)."""
        self.config = config
        self.proposer = proposer
        # A draft model's proposals cost time: chosen lengths first, then proposed (`draft`).
        self.drafter: Drafter | None = None
        self.last_draft_s = 0.0  # the drafter's seconds in this step (the engine zeroes it per step)
        self.draft_wall_s = 0.0  # the drafter's wall seconds since the scheduler last took them
        self.curve = StepCurve(cost_model) if cost_model is not None else None
        k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * k)
        self._indexes: dict[str, NgramIndex] = {}
        # Suffix decoding: each request's own index (how far indexed), and one over the outputs of
        # the last `suffix_decoding_max_cached_requests` finished requests, oldest first.
        self._suffixes: dict[str, tuple[SuffixIndex, int]] = {}
        self._past = SuffixIndex(config.suffix_decoding_max_tree_depth)
        self._past_outputs: deque[list[int]] = deque()
        self._counts: dict[str, tuple[float, float]] = {}  # request id -> faded (proposed, accepted)
        self._first = (0.0, 0.0)  # the engine's drafts judged and their first tokens kept, faded
        # Position i > 0 of a draft: how often it was verified after position i - 1 was kept, and kept.
        self._trials = [0] * k
        self._kept = [0] * k
        # The evidence behind each request's latest lookup: the length of the match its draft
        # follows (the n-gram's n, the suffix's depth; 0: none found). None (absent) for a draft
        # model's proposals and a given proposer's. By match length, faded by `_ENGINE_FADE`:
        # drafts judged and first tokens kept; and per position i > 0, verified after position
        # i - 1 was kept, and kept.
        self._match: dict[str, int] = {}
        self._first_by_match: dict[int, tuple[float, float]] = {}
        self._next_by_match: dict[tuple[int, int], tuple[float, float]] = {}

    def propose(self, request: Request) -> list[int]:
        """Up to `num_speculative_tokens` proposed next tokens of a request whose next step computes
        its last token: never past its max_tokens (the step adds one token of its own), and cut
        where its grammar, if any, would refuse one."""
        cfg = self.config
        k = self.max_length(request)
        if k <= 0:
            return []
        match = None
        if self.proposer is not None:
            draft = self.proposer(request, k)
        elif cfg.method == "draft_model":
            return []  # a draft model proposes through `draft`, once the lengths are chosen
        elif cfg.method == "suffix":
            match, draft = self._suffix_propose(request, k)
        else:
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            match, draft = index.lookup(request.all_token_ids, k)
        if match is not None:
            self._match[request.request_id] = match
        self.stats.num_lookups += 1
        self.stats.num_found += bool(draft)
        if draft and request.grammar is not None:
            draft = draft[:request.grammar.valid_prefix(draft)]
        return draft

    def draft(self, lengths: dict[Request, int]) -> dict[Request, list[int]]:
        """The drafter's proposals, of the lengths chosen (`lengths` on full-length stand-ins),
        cut where a request's grammar would refuse a token."""
        drafter = self.drafter
        assert drafter is not None
        started = time.perf_counter()
        proposals = drafter.propose({r: n for r, n in lengths.items() if n})
        self.draft_wall_s += time.perf_counter() - started
        self.last_draft_s += drafter.last_s
        for request, draft in proposals.items():
            if request.grammar is not None:
                proposals[request] = draft[:request.grammar.valid_prefix(draft)]
        return {r: draft for r, draft in proposals.items() if draft}

    def max_length(self, request: Request) -> int:
        """The most tokens the request may propose now: k, never past its max_tokens."""
        return max(0, min(self.config.num_speculative_tokens,
                          request.max_tokens - request.num_output_tokens - 1))

    def _suffix_propose(self, request: Request, k: int) -> tuple[int, list[int]]:
        """The most frequent continuation of the longest suffix seen before (in the request's own
        tokens or past requests' outputs), token by token while the next token is at least
        `suffix_decoding_min_token_prob` of what followed there, at most the match's length times
        `suffix_decoding_max_spec_factor` (a long match is worth a long proposal); and that
        match's length (0 where none is found)."""
        cfg = self.config
        tokens = request.all_token_ids
        own, indexed = self._suffixes.get(request.request_id, (None, 0))
        if own is None:
            own = SuffixIndex(cfg.suffix_decoding_max_tree_depth)
        own.extend(tokens, indexed, len(tokens))
        self._suffixes[request.request_id] = (own, len(tokens))
        context = tokens[-cfg.suffix_decoding_max_tree_depth:]
        draft: list[int] = []
        limit, match = k, 0
        while len(draft) < limit:
            depth, counts = max(own.longest(context), self._past.longest(context), key=lambda m: m[0])
            if counts is None:
                break
            if not draft:
                match = depth
                limit = min(k, max(1, int(cfg.suffix_decoding_max_spec_factor * depth)))
            token, count = max(counts.items(), key=lambda item: item[1])
            if count < cfg.suffix_decoding_min_token_prob * sum(counts.values()):
                break
            draft.append(token)
            context = [*context[1:], token] if len(context) >= cfg.suffix_decoding_max_tree_depth else [*context, token]
        return match, draft

    def first_rate(self, request: Request, match: int | None = None) -> float:
        """The request's estimated chance that the first token of its draft is kept: its own
        rate, with the engine's as prior; for a draft that follows a match of length `match`,
        the prior is the rate of such drafts, which has the engine's as its own (an n-gram of five
        tokens is kept nearly always, one of two about two times in three, on 2 Zen 4 cores'
        `copy-edit` outputs)."""
        judged, kept = self._first
        prior = (kept + _PRIOR_PROPOSALS * _INITIAL_RATE) / (judged + _PRIOR_PROPOSALS)
        if match is not None:
            judged, kept = self._first_by_match.get(match, (0.0, 0.0))
            prior = (kept + _PRIOR_PROPOSALS * prior) / (judged + _PRIOR_PROPOSALS)
        proposed, accepted = self._counts.get(request.request_id, (0.0, 0.0))
        return (accepted + _PRIOR_PROPOSALS * prior) / (proposed + _PRIOR_PROPOSALS)

    def gains(self, request: Request, length: int, engine_rates: Sequence[float] | None = None) -> list[float]:
        """Per proposed token, the chance it is kept (every one before it kept too). Past the
        first, each position's chance once the one before it was kept is measured on drafts that
        follow a match of the same length, with the engine-wide rate at that position as prior,
        and that has the position before's: proposals that match keep matching, so a position
        never yet verified is not held at `_INITIAL_RATE`, which would keep it out for good.
        `engine_rates`: `_engine_rates` of at least `length` positions, where the caller has them."""
        engine = engine_rates if engine_rates is not None else self._engine_rates(length)
        match = self._match.get(request.request_id)
        chance, out = self.first_rate(request, match), []
        for position in range(length):
            if position:
                if match is None:
                    chance *= engine[position]
                else:
                    trials, kept = self._next_by_match.get((match, position), (0.0, 0.0))
                    chance *= (kept + _PRIOR_PROPOSALS * engine[position]) / (trials + _PRIOR_PROPOSALS)
            out.append(chance)
        return out

    def _engine_rates(self, length: int) -> list[float]:
        """Per position below `length`, the engine-wide chance that a draft's token there is kept
        once the one before it was, each position's prior the one before's (position 0: unused,
        the first token's chance is `first_rate`'s). The same for every request of a step."""
        rates = [_INITIAL_RATE]
        for position in range(1, length):
            rates.append((self._kept[position] + _PRIOR_PROPOSALS * rates[-1])
                         / (self._trials[position] + _PRIOR_PROPOSALS))
        return rates

    def lengths(self, drafts: dict[Request, list[int]], batch: Sequence[SeqWork], budget: int) -> dict[Request, int]:
        """How many of each request's proposed tokens this step verifies, at most `budget` in all.
        `batch`: the step's work without proposals (each drafting request's decode in it first,
        in the order of `drafts`). Without `adaptive`: every proposed token that fits."""
        chosen = dict.fromkeys(drafts, 0)
        candidates = self._candidates(drafts, budget)
        requests = list(drafts)
        take = self._best_count(candidates, requests, batch) if self._adaptive and candidates else len(candidates)
        for _, i in candidates[:take]:
            chosen[requests[i]] += 1
        if self._adaptive:
            for request, length in chosen.items():
                if not length:  # proposed, not verified: its estimates drift back to the engine's
                    self._age(request)
                    if take:  # (else `declined` ages every match length's)
                        self._age_match(self._match.get(request.request_id))
            if candidates and not take:
                self.declined()
        return chosen

    def _age(self, request: Request) -> None:
        """The request's own rate drifts back towards its prior (`_FADE`)."""
        counts = self._counts.get(request.request_id)
        if counts is not None:
            self._counts[request.request_id] = (counts[0] * _FADE, counts[1] * _FADE)

    def _age_match(self, match: int | None) -> None:
        """The rate of drafts after matches of this length drifts back towards the engine's."""
        if match is None:
            return
        counts = self._first_by_match.get(match)
        if counts is not None:
            self._first_by_match[match] = (counts[0] * _ENGINE_FADE, counts[1] * _ENGINE_FADE)

    def declined(self, requests: Iterable[Request] = ()) -> None:
        """A step verified none of the proposals it could have (`lengths` chose none, or `pays`
        said none would pay): the engine-wide estimate of a first proposed token's chance, and
        that by match length, age towards the initial one (`_ENGINE_FADE`), so that a low rate
        measured long ago is put to the test again; so do `requests`' own (by `_FADE`, as a
        request's whose proposal `lengths` kept out: `pays` said no for them)."""
        for request in requests:
            self._age(request)
        judged, kept = self._first
        self._first = (judged * _ENGINE_FADE, kept * _ENGINE_FADE)
        for match in self._first_by_match:
            self._age_match(match)

    def pays(self, drafts: dict[Request, list[int]], batch: Sequence[SeqWork], budget: int) -> bool:
        """Whether `lengths` would verify any of `drafts` (asked with stand-ins of full length
        before any proposal is looked up): whether the likeliest proposed token pays. Nothing is
        learned from the answer. Only the likeliest candidate is weighed, so only each request's
        first proposed token is priced (a request's chances fall with the position): at saturation
        this runs every step, for every decoding request. The lookup has not run, so a request's
        chance is weighed without the match its draft will follow (the request's own rate and the
        engine's): weighed with its last lookup's, a short match once found would keep it from
        looking up again until its estimate aged."""
        if budget <= 0 or not any(drafts.values()):
            return False
        if not self._adaptive:
            return True
        # The first of the likeliest, as `_candidates`' stable sort would put it.
        likeliest = max(((self.first_rate(r), i) for i, (r, draft) in enumerate(drafts.items()) if draft),
                        key=lambda c: c[0])
        rate = self._rate([likeliest], list(drafts), batch)
        return rate(1) > rate(0)

    @property
    def _adaptive(self) -> bool:
        return self.config.adaptive and self.curve is not None

    def _candidates(self, drafts: dict[Request, list[int]], budget: int) -> list[tuple[float, int]]:
        """Every proposed token that may be verified: (the chance it is kept, its request's index in
        `drafts`), most likely first, at most `budget`. A request's own chances fall with the
        position, so its tokens come in order."""
        adaptive = self._adaptive
        engine = self._engine_rates(max(map(len, drafts.values()), default=0)) if adaptive else []
        candidates: list[tuple[float, int]] = []
        for i, (request, draft) in enumerate(drafts.items()):
            chances = self.gains(request, len(draft), engine) if adaptive else [1.0] * len(draft)
            candidates.extend((chance, i) for chance in chances)
        candidates.sort(key=lambda c: -c[0])
        return candidates[:max(0, budget)]

    def _rate(self, candidates: list[tuple[float, int]], requests: list[Request],
              batch: Sequence[SeqWork]) -> _StepRates:
        """Expected tokens per second of the step that verifies the first m candidates, as a
        function of m. A drafter's time to propose them counts in the step's."""
        assert self.curve is not None
        return _StepRates(self.curve, self.drafter, candidates, requests, batch)

    def _best_count(self, candidates: list[tuple[float, int]], requests: list[Request],
                    batch: Sequence[SeqWork]) -> int:
        """The number m of the most likely candidates that maximizes expected tokens per second.
        Within one size class of the step's tokens (`_size_class`: one correction of the curve)
        the chances fall and the step's time grows smoothly, so the rate rises, then falls: each
        class's best m is found by bisection, the first whose next no longer raises it. At a
        class's edge the time may step (the correction measured for 5-8 tokens higher than for
        3-4, a cost model's regime changing), so a longer step can pay where the end of the class
        below does not: every class's best is weighed, and the best of them taken. A class is
        passed over where even its most expected tokens in its shortest step would not beat the
        best so far (in a large batch, most of them)."""
        rate = self._rate(candidates, requests, batch)
        if rate(1) <= rate(0):  # not even the likeliest pays (a saturated batch): ask no further
            return 0
        base = sum(w.num_new_tokens for w in batch)
        best, best_rate, first = 0, rate(0), 1
        while first <= len(candidates):
            low, high = first, min(len(candidates), (1 << _size_class(base + first)) - base)
            first = high + 1
            if rate.tokens(high) / rate.seconds(low) <= best_rate:
                continue
            while low < high:  # the smallest m of the class with rate(m) >= rate(m + 1)
                mid = (low + high) // 2
                if rate(mid + 1) > rate(mid):
                    low = mid + 1
                else:
                    high = mid
            if (found := rate(low)) > best_rate:
                best, best_rate = low, found
        return best

    def observe(self, request: Request, proposed: int, accepted: int) -> None:
        """A verifying step kept `accepted` of the request's `proposed` tokens."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += proposed
        stats.num_accepted_tokens += accepted
        judged, kept = self._first
        self._first = (judged * _ENGINE_FADE + 1, kept * _ENGINE_FADE + (accepted > 0))
        for position in range(accepted):
            stats.accepted_per_position[position] += 1
        for position in range(1, min(proposed, accepted + 1)):
            self._trials[position] += 1
            self._kept[position] += position < accepted
        match = self._match.get(request.request_id)
        if match is not None:
            judged, kept = self._first_by_match.get(match, (0.0, 0.0))
            self._first_by_match[match] = (judged * _ENGINE_FADE + 1, kept * _ENGINE_FADE + (accepted > 0))
            for position in range(1, min(proposed, accepted + 1)):
                trials, kept = self._next_by_match.get((match, position), (0.0, 0.0))
                self._next_by_match[match, position] = (trials * _ENGINE_FADE + 1,
                                                        kept * _ENGINE_FADE + (position < accepted))
        had, kept = self._counts.get(request.request_id, (0.0, 0.0))
        self._counts[request.request_id] = (had * _FADE + 1, kept * _FADE + (accepted > 0))

    def observe_step(self, batch: Sequence[SeqWork], measured_s: float) -> None:
        """A step of `batch` took `measured_s`."""
        if self.curve is not None:
            self.curve.observe(batch, measured_s)

    def forget(self, request: Request) -> None:
        """The request has finished: its index and counts go; with suffix decoding its output
        joins the cache of past outputs (the oldest leaves past the cache's size)."""
        self._indexes.pop(request.request_id, None)
        self._counts.pop(request.request_id, None)
        self._match.pop(request.request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        if self._suffixes.pop(request.request_id, None) is None:
            return
        limit = self.config.suffix_decoding_max_cached_requests
        if limit and request.output_token_ids:
            output = list(request.output_token_ids)
            self._past.extend(output, 0, len(output))
            self._past_outputs.append(output)
            while len(self._past_outputs) > limit:
                self._past.remove(self._past_outputs.popleft())
