"""Speculative decoding: n-gram, suffix and draft-model proposals verified inside the continuous
batch give the tokens of decoding one at a time (greedy), keep the model's distribution
(sampled), keep logprobs, stop rules and grammars; the lengths follow the step's cost; the
counters reach /metrics and the step timeline."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_loading import TINY, save_word_tokenizer, tiny_hf_model

from inflight import LLM, ConfigError, SamplingParams
from inflight.bench.plots import plot_timelines
from inflight.bench.timeline import Timeline
from inflight.bench.workload import parse_workload
from inflight.config import SpeculativeConfig
from inflight.engine import speculative
from inflight.engine.sampler import Sampler
from inflight.engine.speculative import NgramIndex, Speculator, SuffixIndex
from inflight.engine.stats import EngineStats
from inflight.model.loaded import LoadedModel
from inflight.model.loader import default_model_path
from inflight.perf.cost_model import SeqWork
from inflight.perf.profiles import load_hardware
from inflight.request import Request, StructuredOutputs
from inflight.server.metrics import ServerMetrics
from inflight.sim.runs import SimTarget, simulate
from inflight.sim.shapes import resolve_shapes
from inflight.sim.validate import measured_acceptance_rate
from inflight.sim.workload import synthetic_requests

PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
           "must be in want of a wife. However little known the feelings or views of such a man may be "
           "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
           "surrounding families, that he is considered the rightful property of some one or other of "
           "their daughters.")
# Prompts whose continuations repeat what came before (the model copies, or loops).
COPY_PROMPTS = [f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:\n{PASSAGE[:80]}",
                "Count: one, two, three, one, two, three, one, two, three, one, two,",
                "The capital of France is"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def test_ngram_index_proposes_what_followed_the_longest_latest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # The 3-gram (2, 6, 7) never occurred before; the 2-gram (6, 7) did, latest at 5..7, then 1, 2.
    assert index.propose(tokens, 3) == [1, 2, 6]
    tokens += [1, 2, 3]
    assert index.propose(tokens, 2) == []  # (2, 3), (3): never seen
    tokens += [4, 5, 6, 7, 1]
    assert index.propose(tokens, 4) == [2, 3, 4, 5]  # (6, 7, 1) at 9..12, latest
    assert NgramIndex(2, 2).propose([1, 2, 3], 2) == []


def test_suffix_index_counts_what_followed_and_forgets() -> None:
    index = SuffixIndex(4)
    first, second = [1, 2, 3, 4, 1, 2, 3, 5], [1, 2, 3, 4]
    index.extend(first, 0, len(first))
    assert index.longest([9, 1, 2, 3]) == (3, {4: 1, 5: 1})  # (1, 2, 3) followed by 4, then by 5
    index.extend(second, 0, len(second))
    assert index.longest([1, 2, 3]) == (3, {4: 2, 5: 1})
    assert index.longest([7, 8]) == (0, None)
    index.remove(first)
    assert index.longest([1, 2, 3]) == (3, {4: 1})
    index.remove(second)
    assert index.longest([1]) == (0, None) and not index._next  # every count gone, no empty entry left


def test_suffix_proposals_come_from_the_request_and_from_past_outputs() -> None:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8, suffix_decoding_max_tree_depth=8,
                               suffix_decoding_max_cached_requests=2)
    spec = Speculator(config, None)
    own = Request("a", [5, 6, 7, 8, 9, 10, 11, 5, 6, 7], SamplingParams(max_tokens=50))
    # (5, 6, 7) matched: 3 tokens at most (spec factor 1.0), the continuation seen after it.
    assert spec.propose(own) == [8, 9, 10]
    past = Request("b", [1], SamplingParams(max_tokens=50))
    past.output_token_ids = [40, 41, 42, 43, 44, 45, 46, 47]
    spec.propose(past)
    spec.forget(past)  # finished: its output joins the cache
    later = Request("c", [2, 3, 40, 41, 42, 43], SamplingParams(max_tokens=50))
    assert spec.propose(later) == [44, 45, 46, 47]
    for i in range(2):  # two more finished requests push "b" out of a cache of 2
        other = Request(f"x{i}", [1], SamplingParams(max_tokens=50))
        other.output_token_ids = [90 + i, 91 + i]
        spec.propose(other)
        spec.forget(other)
    assert spec.propose(Request("d", [2, 3, 40, 41, 42, 43], SamplingParams(max_tokens=50))) == []


def test_the_config_takes_vllms_json_and_names_what_is_wrong() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.adaptive) == (3, 4, True)
    for text, message in [("{x", "not JSON"), ('{"method": "eagle"}', "method must be one of"),
                          ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be"),
                          ('{"k": 2}', "unknown key 'k'"),
                          ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "exceeds prompt_lookup_max")]:
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(text)
    with pytest.raises(ConfigError, match="static"):
        LLM(speculative_config=NGRAM, scheduling_policy="static")


def test_a_bad_config_on_the_command_line_is_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "inflight.cli", "generate", "Hi", "--max-tokens", "2",
                             "--speculative-config", '{"method": "medusa"}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "method must be one of" in result.stderr


def _constant_cost(batch: Any) -> float:
    return 0.010  # every step reads the weights once: extra tokens are free


def _per_token_cost(batch: Any) -> float:
    return 0.002 * sum(w.num_new_tokens for w in batch)  # compute-bound: each token costs its share


class _Model:
    def __init__(self, cost: Callable[[Any], float]) -> None:
        self.step_time = cost


def test_lengths_follow_the_cost_of_a_step() -> None:
    """Where extra tokens cost nothing, every proposal is verified; where each token costs its
    share of the step (saturation), a proposal worth less than a token is never verified."""
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50)) for i in range(4)]
    drafts = {r: [7, 8, 9] for r in requests}
    batch = [SeqWork(1, 10, 1) for _ in requests]
    free = Speculator(SpeculativeConfig(num_speculative_tokens=3), _Model(_constant_cost))
    assert set(free.lengths(drafts, batch, budget=100).values()) == {3}
    assert sum(free.lengths(drafts, batch, budget=5).values()) == 5  # within the step's budget
    saturated = Speculator(SpeculativeConfig(num_speculative_tokens=3), _Model(_per_token_cost))
    assert set(saturated.lengths(drafts, batch, budget=100).values()) == {0}
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=3, adaptive=False), _Model(_per_token_cost))
    assert set(fixed.lengths(drafts, batch, budget=100).values()) == {3}
    # The scheduler's question before looking proposals up: whether any would be verified.
    for speculator in (free, saturated, fixed):
        assert speculator.pays(drafts, batch, budget=100) == any(speculator.lengths(drafts, batch, 100).values())
    assert free.pays(drafts, batch, budget=100) and not saturated.pays(drafts, batch, budget=100)
    assert not free.pays(drafts, batch, budget=0) and not fixed.pays(drafts, batch, budget=0)


def test_pays_answers_what_lengths_would_on_random_steps() -> None:
    """`pays` weighs only the likeliest first proposed token; on random steps (requests with
    different acceptance, empty drafts, budgets, step costs that grow by each token or faster) it
    answers as whether `lengths` would verify anything, both ways."""
    import random

    rng = random.Random(0)
    answers = []
    for _ in range(300):
        fixed, per_token = rng.uniform(0, 0.02), rng.uniform(0, 0.004)
        power, k = rng.choice([1.0, 1.5]), rng.randint(1, 8)

        def cost(batch: Any, fixed: float = fixed, per_token: float = per_token, power: float = power) -> float:
            return fixed + per_token * sum(w.num_new_tokens for w in batch) ** power

        spec = Speculator(SpeculativeConfig(num_speculative_tokens=k), _Model(cost))
        requests = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=50)) for i in range(rng.randint(1, 6))]
        for request in requests:
            for _ in range(rng.randint(0, 5)):
                spec.observe(request, k, rng.randint(0, k))
        drafts = {r: [0] * rng.randint(0, k) for r in requests}
        batch = [SeqWork(1, rng.randint(5, 300), 1) for _ in requests]
        budget = rng.randint(0, 20)
        paid = spec.pays(drafts, batch, budget)
        assert paid == any(spec.lengths(drafts, batch, budget).values())
        answers.append(paid)
    assert 0.2 < sum(answers) / len(answers) < 0.8  # both answers, often


def test_lengths_learn_from_what_is_kept() -> None:
    """A request whose proposals keep missing stops proposing in a step where tokens cost
    something; one whose proposals are kept proposes its whole draft."""
    def cost(batch: Any) -> float:
        return 0.010 + 0.004 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
    good, bad = (Request(name, [1, 2], SamplingParams(max_tokens=50)) for name in ("good", "bad"))
    for _ in range(10):
        spec.observe(good, 4, 4)
        spec.observe(bad, 4, 0)
    lengths = spec.lengths({good: [1, 2, 3, 4], bad: [1, 2, 3, 4]}, [SeqWork(1, 10, 1)] * 2, budget=100)
    assert lengths == {good: 4, bad: 0}
    assert spec.stats.num_drafts == 20 and spec.stats.accepted_per_position == [10, 10, 10, 10]


def test_a_length_once_measured_slow_is_tried_again() -> None:
    """Two slow steps of five tokens (something else slowed them) make four the better length,
    but only until that size has gone unmeasured for a while: then it borrows its neighbour's
    measure, is verified again, and is known again."""
    def cost(batch: Any) -> float:
        return 0.010 + 0.001 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
    request = Request("r", [1, 2], SamplingParams(max_tokens=500))
    for _ in range(10):
        spec.observe(request, 4, 4)

    def length() -> int:
        return spec.lengths({request: [1, 2, 3, 4]}, [SeqWork(1, 10, 1)], budget=100)[request]

    def step(tokens: int, slower: float = 1.0) -> None:
        work = [SeqWork(tokens, 10 + tokens, tokens)]
        spec.observe_step(work, cost(work) * slower)

    assert length() == 4
    step(4)
    step(5, slower=3.0)
    step(5, slower=3.0)
    assert length() == 3
    for _ in range(speculative._STALE_STEPS - 1):
        step(4)
    assert length() == 3  # still within memory
    step(4)
    assert length() == 4  # forgotten: tried again
    step(5)
    assert length() == 4  # and now known to pay


def test_an_estimate_that_keeps_proposals_out_is_tested_again() -> None:
    """Eight rejected drafts put the engine's estimate below what a verified token costs here, so
    no proposal is verified and none could raise it again; steps that decline proposals age it
    back until one is verified. A probe that fails again puts it back down; once proposals are
    kept, every step verifies."""
    def cost(batch: Any) -> float:  # a proposed token costs a third of a step
        return 0.006 + 0.002 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
    for i in range(8):
        spec.observe(Request(f"sampled{i}", [1, 2], SamplingParams(max_tokens=50)), 4, 0)
    copying = Request("copying", [1, 2], SamplingParams(max_tokens=500))
    batch = [SeqWork(1, 10, 1)]

    def steps_until_verified() -> int:
        for step in range(1000):
            if spec.lengths({copying: [1, 2, 3, 4]}, batch, budget=100)[copying]:
                return step
        return -1

    first = steps_until_verified()
    assert 10 < first < 200  # declined for a while (it did not pay), then tried
    spec.observe(copying, 1, 0)  # the probe fails: declined again for a while
    assert steps_until_verified() > 5
    for _ in range(3):
        spec.observe(copying, 4, 4)
    assert all(spec.lengths({copying: [1, 2, 3, 4]}, batch, budget=100)[copying] for _ in range(20))
    # `pays` answers without learning; the scheduler ages the estimate when it says no.
    stuck = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
    for i in range(8):
        stuck.observe(Request(f"sampled{i}", [1, 2], SamplingParams(max_tokens=50)), 4, 0)
    full = {copying: [0, 0, 0, 0]}
    assert not stuck.pays(full, batch, 100) and not stuck.pays(full, batch, 100)
    declines = 0
    while not stuck.pays(full, batch, 100):
        stuck.declined()
        declines += 1
    assert 10 < declines < 200


def test_a_drafts_chance_follows_the_length_of_the_match_it_came_from() -> None:
    """Drafts that follow a five-token n-gram have been kept, drafts that follow a two-token one
    rejected: a new request's draft is verified after a long match and not after a short one,
    where the engine-wide rate alone would weigh both alike."""
    def cost(batch: Any) -> float:
        return 0.010 + 0.003 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
    long_match = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 1, 2, 3, 4, 5]  # 1..5 again: n = 5
    short_match = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 30, 31, 4, 5]  # only (4, 5) again: n = 2
    for i in range(12):
        for name, tokens, kept in (("long", long_match, 4), ("short", short_match, 0)):
            request = Request(f"{name}{i}", tokens, SamplingParams(max_tokens=50))
            assert spec.propose(request) == [6, 7, 8, 9]
            spec.observe(request, 4, kept)
    fresh = {Request(name, tokens, SamplingParams(max_tokens=50)): tokens
             for name, tokens in (("long", long_match), ("short", short_match))}
    drafts = {request: spec.propose(request) for request in fresh}
    lengths = spec.lengths(drafts, [SeqWork(1, 20, 1)] * 2, budget=100)
    assert [lengths[r] for r in fresh] == [4, 0]


def test_a_position_never_verified_takes_the_rate_of_the_one_before() -> None:
    """Every draft so far was verified up to four tokens and kept whole; with k = 8 and extra
    tokens cheap, a whole draft of eight is verified: positions 5 to 8, never measured, are not
    taken at the initial even chance, which would halve the chance at each and keep them out
    for good."""
    def cost(batch: Any) -> float:
        return 0.010 + 0.001 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8), _Model(cost))
    for i in range(20):
        spec.observe(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=50)), 4, 4)
    request = Request("r", [1, 2], SamplingParams(max_tokens=50))
    assert spec.lengths({request: list(range(8))}, [SeqWork(1, 10, 1)], budget=100)[request] == 8


def test_the_best_length_is_found_past_a_step_in_the_measured_curve() -> None:
    """Steps of 9-16 tokens measured 1.15x what the model predicts, shorter ones as predicted:
    an eighth proposed token costs more than it brings, but fourteen still beat seven. The
    lengths weigh each size class's best, where a bisection over all lengths, meeting the fall
    at the class's edge first, settled for seven."""
    def cost(batch: Any) -> float:
        return 0.010 + 0.0003 * sum(w.num_new_tokens for w in batch)

    spec = Speculator(SpeculativeConfig(num_speculative_tokens=14), _Model(cost))
    for i in range(20):
        spec.observe(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=50)), 14, 14)
    for tokens, slower in ((1, 1.0), (2, 1.0), (4, 1.0), (6, 1.0), (12, 1.15)):
        work = [SeqWork(tokens, 10 + tokens, tokens)]
        spec.observe_step(work, cost(work) * slower)
    request = Request("r", [1, 2], SamplingParams(max_tokens=50))
    rate = spec._rate([(chance, 0) for chance in spec.gains(request, 14)], [request], [SeqWork(1, 10, 1)])
    assert rate(8) < rate(7) < rate(14)  # the rate falls at the class's edge, and rises past it
    assert spec.lengths({request: list(range(14))}, [SeqWork(1, 10, 1)], budget=100)[request] == 14


def test_a_request_kept_out_by_pays_drifts_back_to_the_engines_rate() -> None:
    """The scheduler asks `pays` before any lookup; where it says no, the requests it weighed
    age back towards the engine's rate (`declined(requests)`), as a request whose proposal
    `lengths` kept out does: a request whose first drafts missed, in an engine whose drafts are
    kept, is soon tested again, where its own low rate alone would keep it out for long."""
    def cost(batch: Any) -> float:
        return 0.006 + 0.002 * sum(w.num_new_tokens for w in batch)

    def steps_until_pays(ages_requests: bool) -> int:
        spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), _Model(cost))
        for i in range(20):
            spec.observe(Request(f"copying{i}", [1, 2], SamplingParams(max_tokens=50)), 4, 4)
        late = Request("late", [1, 2], SamplingParams(max_tokens=500))
        for _ in range(8):
            spec.observe(late, 4, 0)  # its opening words: nothing to copy yet
        full, batch = {late: [0, 0, 0, 0]}, [SeqWork(1, 10, 1)]
        for step in range(200):
            if spec.pays(full, batch, 100):
                return step
            spec.declined([late] if ages_requests else [])
        return 200

    assert 0 < steps_until_pays(True) <= 10 < steps_until_pays(False)


def test_the_replay_prices_a_policy_and_the_bound_no_policy_passes() -> None:
    """`benchmarks/speculative_replay.py`: outputs that copy their prompt, replayed through a
    Speculator on a step-time curve: every output token made once, the oracle's lengths never
    slower than the policy's, fixed lengths verifying whole drafts, and a step's price the curve's."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative_replay.py"
    module_spec = importlib.util.spec_from_file_location("speculative_replay", path)
    assert module_spec is not None and module_spec.loader is not None
    replay = importlib.util.module_from_spec(module_spec)
    sys.modules["speculative_replay"] = replay
    module_spec.loader.exec_module(replay)
    curve = replay.MeasuredCurve([1, 5, 9], [0.007, 0.011, 0.017], prefill_s=0.25)
    assert curve(3) == pytest.approx(0.009) and curve(13) == pytest.approx(0.023)
    passage = [(7 * i) % 50 + 3 for i in range(40)]
    outputs = [(passage + passage[:5], passage[5:] + [99, 98, 97] + passage[:20]),
               (list(range(60, 90)), list(range(90, 130)))]  # nothing to copy
    for config in (SpeculativeConfig(num_speculative_tokens=4), SpeculativeConfig(num_speculative_tokens=8),
                   SpeculativeConfig(num_speculative_tokens=4, adaptive=False)):
        policy, oracle = replay.replay(outputs, lambda c=config: Speculator(c, replay.CurveCost(curve)), curve)
        for done in (policy, oracle):
            assert done.steps + done.kept == sum(len(out) - 1 for _, out in outputs)
        assert oracle.seconds <= policy.seconds + 1e-12 and oracle.kept > 0
        assert policy.steps < sum(len(out) - 1 for _, out in outputs)  # the copy was proposed and kept
    fixed_policy, _ = replay.replay(outputs[1:], lambda: Speculator(SpeculativeConfig(num_speculative_tokens=4,
                                                                                       adaptive=False),
                                                                    replay.CurveCost(curve)), curve)
    assert fixed_policy.verifying == 0 and fixed_policy.seconds == pytest.approx(39 * 0.007)


def test_the_benchmark_runs_a_revisions_speculator_beside_this_checkouts() -> None:
    """`benchmarks/speculative.py --against REV`: REV's Speculator is loaded as a module of its
    own, and while a round's engines are built each speculating one gets this checkout's class or
    the revision's, in the order of the plans; the engine's own is back afterwards."""
    import importlib.util

    from inflight.bench.runs import RunPlan
    from inflight.engine import engine as engine_module

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "speculative.py"
    spec = importlib.util.spec_from_file_location("speculative_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    theirs = bench.speculator_of("HEAD")
    assert theirs is not Speculator and theirs.__name__ == "Speculator" and theirs.__module__ != Speculator.__module__
    config = SpeculativeConfig(num_speculative_tokens=2)
    plans = [RunPlan("ngram2@HEAD#1", {"speculative_config": {}}), RunPlan("off#1", {}),
             RunPlan("ngram2#1", {"speculative_config": {}})]
    with bench.speculators(plans, theirs):
        built = [engine_module.Speculator(config, None), engine_module.Speculator(config, None)]
    assert [type(s) for s in built] == [theirs, Speculator]
    assert engine_module.Speculator is Speculator


LOGITS = [torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5]), torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 0.0]),
          torch.tensor([1.0, 1.0, 0.0, 0.0, 2.0, -2.0])]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["plain", "tempered-top-k"])
def test_verified_tokens_keep_the_models_distribution(params: SamplingParams) -> None:
    """Rejection sampling against n-gram proposals (certain of their token): the first new token
    is distributed as the first row's p, whatever was proposed; the second, after the first
    proposal was kept, as the second row's."""
    num = 6000
    sampler = Sampler(torch.device("cpu"), seed=0)
    requests = [Request(f"r{i}", [1], params) for i in range(num)]
    draft = [1, 2]  # proposed: token 1 (p about 0.2 in row 0), then token 2
    logits = torch.stack(LOGITS).repeat(num, 1)
    tokens = sampler.sample(logits, requests, [draft] * num)
    probe = Sampler(torch.device("cpu"))
    p = [probe._probs(row.unsqueeze(0), [params])[0].double() for row in LOGITS]
    p = [q / q.sum() for q in p]

    def check(found: list[int], q: torch.Tensor) -> None:
        freq = torch.bincount(torch.tensor(found), minlength=len(q)).double() / len(found)
        sigma = (q * (1 - q) / len(found)).sqrt()
        assert bool(((freq - q).abs() <= 5 * sigma + 1e-12).all()), (freq, q)

    check([t[0] for t in tokens], p[0])
    check([t[1] for t in tokens if t[0] == draft[0]], p[1])
    assert all(t[:len(t) - 1] == draft[:len(t) - 1] for t in tokens)  # kept proposals, then one token


SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


def _greedy_with_and_without(make_llm: Callable[..., LLM], config: dict[str, Any],
                             max_tokens: tuple[int, int]) -> tuple[LLM, list[Any], list[Any]]:
    """COPY_PROMPTS greedily (logprobs; a stop string; a presence penalty with n = 2) without
    speculation and with `config`; asserts the same tokens and finish reasons. (the engine with
    speculation, its outputs, the outputs without)"""
    params = [SamplingParams(max_tokens=max_tokens[0], temperature=0, logprobs=2),
              SamplingParams(max_tokens=max_tokens[1], temperature=0, stop=[", three, one"]),
              SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.5, n=2)]
    plain = make_llm().generate(COPY_PROMPTS, params)
    llm = make_llm(speculative_config=config)
    spec = llm.generate(COPY_PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    return llm, spec, plain


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_outputs_logprobs_and_stops_equal_decoding_one_at_a_time(make_llm: Callable[..., LLM],
                                                                        config: dict[str, Any]) -> None:
    llm, spec, plain = _greedy_with_and_without(make_llm, config, (60, 40))
    assert [o.text for o in spec] == [o.text for o in plain]
    # A verify's rows are the decodes of one token at a time, bit for bit: the same logprobs.
    assert [(t.token_id, t.logprob, t.top) for t in spec[0].logprobs or []] == \
        [(t.token_id, t.logprob, t.top) for t in plain[0].logprobs or []]
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens >= 20, stats
    # Every lookup of a request's proposals is counted, and those that found one: at least each
    # verifying step's, and at most every lookup.
    assert stats.spec_num_drafts <= stats.spec_num_found <= stats.spec_num_lookups, stats
    # The scheduler's own time on speculation is counted, a small part of the run's.
    assert 0 < stats.spec_overhead_s < sum(r.duration_s for r in llm.engine.step_records)
    assert llm.engine.block_manager.num_used_blocks == 0


SELF_DRAFT = {"method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": 3,
              "adaptive": False}


@pytest.mark.parametrize("config", [NGRAM, SELF_DRAFT], ids=["ngram", "draft"])
def test_structured_output_with_proposals_is_the_same(make_llm: Callable[..., LLM], config: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
              "required": ["name", "tags"]}
    prompt = ('Give JSON like {"name": "a", "tags": ["red", "green", "blue", "red", "green", "blue"]} for '
              "a shop, with many tags:")
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=StructuredOutputs(json=schema))
    plain = make_llm().generate(prompt, params)[0]
    llm = make_llm(speculative_config=config)
    spec = llm.generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_sampled_requests_with_proposals_finish_and_free_their_blocks(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(speculative_config={**NGRAM, "adaptive": False}, max_batch_size=4)
    outs = llm.generate(COPY_PROMPTS * 2, SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=5))
    assert all(len(o.token_ids) >= 5 for o in outs)
    again = make_llm(speculative_config={**NGRAM, "adaptive": False}, max_batch_size=4).generate(
        COPY_PROMPTS * 2, SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_tokens=5))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # seeded: the same draws
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.stats().spec_num_drafts > 0


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_a_seeded_requests_sampled_tokens_are_those_it_gets_without_speculation(make_llm: Callable[..., LLM],
                                                                               config: dict[str, Any]) -> None:
    """A sampled row draws its token as a step without proposals draws it and keeps the proposal
    where the draw is it: a seeded request's tokens are the same with speculation as without,
    alone or beside others, whatever lengths the batch's steps let it verify (top-p, a penalty and
    n = 2 among them)."""
    prompts = [*COPY_PROMPTS, "Tell me a story about a dragon."]
    params = [SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=40, temperature=0.7, presence_penalty=0.3, seed=5, n=2)
    plain = [o.token_ids for o in make_llm().generate(prompts, params)]  # n outputs a prompt, in order
    llm = make_llm(speculative_config=config)
    alone = [o.token_ids for prompt, p in zip(prompts, params, strict=True) for o in llm.generate([prompt], [p])]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(plain) == len(prompts) + 1
    assert alone == plain and together == plain
    assert llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_the_speculator_holds_nothing_of_a_finished_or_aborted_request(make_llm: Callable[..., LLM],
                                                                       method: str) -> None:
    """Per-request state (indexes, rates, the last lookup's match length) goes when a request
    finishes or is aborted mid-stream; only the engine-wide estimates stay."""
    llm = make_llm(speculative_config={"method": method, "num_speculative_tokens": 4}, max_batch_size=4)
    engine = llm.engine
    requests = [engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for prompt in COPY_PROMPTS]
    for _ in range(6):
        engine.step()
    assert engine.abort(requests[0].request_id)
    while engine.has_unfinished():
        engine.step()
    speculator = engine.speculator
    assert speculator is not None and speculator.stats.num_lookups > 0
    held = (speculator._indexes, speculator._suffixes, speculator._counts, speculator._match)
    assert not any(held), held
    assert engine.block_manager.num_used_blocks == 0


# --- a draft model --------------------------------------------------------------------------------


def _random_draft(path: Path, loaded: LoadedModel, tokenizer: str = "target") -> str:
    """A 2-layer random-weight Llama with the embedded model's vocabulary (its tokenizer, or a
    word-level one of the same size) saved as transformers saves one."""
    import transformers

    vocab = loaded.model.config.vocab_size
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    if tokenizer == "target":
        loaded.tokenizer.hf.save_pretrained(path)
    else:
        save_word_tokenizer(path, vocab)
    return str(path)


@pytest.mark.parametrize("arch", ["deepseek_v2", "lfm2_moe", "qwen2_moe"])
def test_a_requests_logprobs_are_the_same_whoever_shares_its_step_and_whatever_it_verifies(tmp_path: Path,
                                                                                            arch: str) -> None:
    """Latent attention's up-projections (DeepSeek's), experts chosen by sigmoids (LFM2-MoE's) and a
    shared expert's sigmoid gate (Qwen2-MoE's): a request's logprobs bit for bit the same alone,
    beside others, with its prompt in chunks (the steps shared otherwise), and verifying proposals
    (every one found, `adaptive` off): so its greedy tokens are too, whatever the near-ties. (On
    inflight's CPU kernels, whose matmuls give a row the same sums whatever rows share the call.)"""
    from inflight.model.linear import linear_backend

    if linear_backend(torch.device("cpu"), torch.float32) != "inflight":
        pytest.skip("the matmuls here are PyTorch's or oneDNN's (no AVX2 kernels): rows not batch-invariant")
    tiny_hf_model(arch).save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path, TINY["vocab"])
    prompts = [{"prompt_token_ids": ids} for ids in ([5 + i % 7 for i in range(40)], list(range(10, 60)) * 2, [9] * 30,
                                                     list(range(100, 107)))]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(model=str(tmp_path), num_kv_blocks=64, block_size=16)
    alone = [llm.generate([prompt], params)[0] for prompt in prompts]
    runs = {"batched": llm.generate(prompts, params),
            "chunked": LLM(model=str(tmp_path), num_kv_blocks=64, block_size=16, max_num_tokens=16).generate(
                prompts, params)}
    speculating = LLM(model=str(tmp_path), num_kv_blocks=64, block_size=16,
                      speculative_config={**NGRAM, "adaptive": False})
    runs["speculating"] = speculating.generate(prompts, params)
    assert speculating.engine.scheduler.speculator.stats.num_accepted_tokens > 0
    for name, outs in runs.items():
        for want, got in zip(alone, outs, strict=True):
            assert got.token_ids == want.token_ids, name
            assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs], name


def test_a_draft_model_proposes_and_greedy_outputs_equal_decoding_one_at_a_time(make_llm: Callable[..., LLM]) -> None:
    """The embedded model drafting for itself: every proposal its own argmax, so nearly all are
    kept; outputs, logprobs' tokens and stops as without; both KV pools empty after."""
    llm, spec, plain = _greedy_with_and_without(make_llm, SELF_DRAFT, (40, 30))
    assert [[t.token_id for t in o.logprobs or []] for o in spec] == [[t.token_id for t in o.logprobs or []]
                                                                      for o in plain]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens >= 40 and stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_position[2] > 0  # three proposals a step, from three draft passes
    drafter = llm.engine.speculator.drafter
    assert llm.engine.block_manager.num_used_blocks == 0 and drafter.block_manager.num_used_blocks == 0
    assert any(r.draft_s > 0 for r in llm.engine.step_records)


def test_a_random_draft_survives_rejections_preemption_and_sampling(make_llm: Callable[..., LLM],
                                                                    loaded: LoadedModel, tmp_path: Path) -> None:
    """A draft that is nearly always wrong: its rejected tokens' KV (in both pools) is
    overwritten, never read; preemption in a pool too small for the batch, sampled and greedy
    requests together: the greedy ones equal decoding without, every block comes back."""
    config = {"method": "draft_model", "model": _random_draft(tmp_path, loaded), "num_speculative_tokens": 4,
              "adaptive": False}
    prompts = COPY_PROMPTS * 2
    params = [SamplingParams(max_tokens=24, temperature=0)] * 3 + [SamplingParams(max_tokens=24, temperature=0.9,
                                                                                   seed=5)] * 3
    plain = make_llm(num_kv_blocks=24).generate(prompts, params)
    llm = make_llm(num_kv_blocks=24, speculative_config=config)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec[:3]] == [o.token_ids for o in plain[:3]]
    assert all(len(o.token_ids) == 24 for o in spec[3:])
    assert llm.engine.stats().spec_num_draft_tokens > 0 and llm.engine.stats().num_preemptions > 0
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.speculator.drafter.block_manager.num_used_blocks == 0


def test_a_draft_model_with_another_vocabulary_or_no_path_is_refused(loaded: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="another tokenizer"):
        LLM(loaded=loaded, num_kv_blocks=16, speculative_config={
            "method": "draft_model", "model": _random_draft(tmp_path, loaded, tokenizer="words")})
    with pytest.raises(ConfigError, match='needs "model"'):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ConfigError, match='"model" is for method "draft_model"'):
        SpeculativeConfig.parse({"method": "ngram", "model": "x"})


def test_metrics_carry_vllms_spec_decode_names() -> None:
    stats = EngineStats(spec_num_drafts=5, spec_num_draft_tokens=18, spec_num_accepted_tokens=9,
                        spec_accepted_per_position=(4, 3, 2, 0))
    text = ServerMetrics(lambda: stats).render().decode()
    assert "inflight:spec_decode_num_drafts_total 5.0" in text
    assert "inflight:spec_decode_num_draft_tokens_total 18.0" in text
    assert "inflight:spec_decode_num_accepted_tokens_total 9.0" in text
    assert 'inflight:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3.0' in text


# --- the simulator --------------------------------------------------------------------------------


def _sim_run(options: dict[str, Any], num_requests: int, concurrency: int | None) -> Any:
    name, shapes = resolve_shapes("llama-3-8b")
    spec = parse_workload({"name": "s", "seed": 2, "num_requests": num_requests, "arrivals": {"kind": "burst"},
                           "prompt_len": {"kind": "uniform", "min": 64, "max": 256},
                           "output_len": {"kind": "uniform", "min": 64, "max": 128}})
    return simulate(SimTarget(name, shapes, load_hardware("h100")), options, synthetic_requests(spec),
                    max_concurrency=concurrency)


def test_the_simulator_speculates_at_the_workloads_acceptance_rate(tmp_path: Path) -> None:
    """On an H100, one stream of an 8B model is bound by reading its weights: proposals kept 80%
    of the time make it faster, and at the same rate every stream of a saturated batch is no
    slower than without (the lengths fall to what pays). The step timeline shows the proposals."""
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}, "acceptance_rate": 0.8}
    off, on = _sim_run({}, 4, 1), _sim_run(spec, 4, 1)
    assert on.metrics.total_output_tokens == off.metrics.total_output_tokens
    assert on.metrics.output_throughput > 1.5 * off.metrics.output_throughput
    assert on.metrics.spec_tokens_per_draft is not None and on.metrics.spec_tokens_per_draft > 2
    steps = on.capture.timeline.steps
    proposed, kept = sum(s.num_spec_tokens for s in steps), sum(s.num_accepted_tokens for s in steps)
    assert on.metrics.spec_acceptance_perc == pytest.approx(100 * kept / proposed)
    again = Timeline.from_dict(on.capture.timeline.to_dict()).steps
    assert [(s.num_spec_tokens, s.num_accepted_tokens) for s in again] == [(s.num_spec_tokens, s.num_accepted_tokens)
                                                                           for s in steps]
    assert plot_timelines([off, on], tmp_path / "timeline.png").stat().st_size > 0
    busy_off, busy_on = _sim_run({"max_batch_size": 256}, 256, None), _sim_run({**spec, "max_batch_size": 256}, 256,
                                                                                None)
    assert busy_on.metrics.output_throughput >= 0.98 * busy_off.metrics.output_throughput
    fixed = {**spec, "speculative_config": {**spec["speculative_config"], "adaptive": False}}
    never = _sim_run({**fixed, "acceptance_rate": 0.0}, 4, 1)
    assert never.metrics.spec_acceptance_perc == 0 and never.metrics.output_throughput < off.metrics.output_throughput


def test_the_simulator_prices_a_draft_models_passes() -> None:
    """Llama-3.2-1B drafting for an 8B on an H100: a pass costs a fraction of the target's step,
    so at 0.8 kept one stream is faster; proposals never kept cost fixed-length speculation its
    draft passes, and the adaptive length, learning that, stays within a few percent of off."""
    draft = {"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4}
    off = _sim_run({}, 4, 1)
    on = _sim_run({"speculative_config": draft, "acceptance_rate": 0.8}, 4, 1)
    assert on.metrics.output_throughput > 1.3 * off.metrics.output_throughput
    fixed = _sim_run({"speculative_config": {**draft, "adaptive": False}, "acceptance_rate": 0.0}, 4, 1)
    adaptive = _sim_run({"speculative_config": draft, "acceptance_rate": 0.0}, 4, 1)
    assert fixed.metrics.output_throughput < 0.8 * off.metrics.output_throughput
    assert adaptive.metrics.output_throughput > 0.95 * off.metrics.output_throughput


def test_a_measured_runs_acceptance_converts_to_the_simulators_rate() -> None:
    """`inflight sim --against` re-simulates a speculating run at the rate its counters imply."""
    run = _sim_run({"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                    "acceptance_rate": 0.7}, 8, 1)
    assert measured_acceptance_rate(run.metrics) == pytest.approx(0.7, abs=0.04)
    assert measured_acceptance_rate(_sim_run({}, 2, 1).metrics) is None


def test_the_simulator_finds_proposals_at_the_workloads_proposal_rate() -> None:
    """Where a request's text stops repeating itself its lookups find nothing: at a proposal rate
    of 0.5 the simulated stream finds proposals at about half its lookups, measured as a real run's
    are, and runs between never finding them and always; `--against` re-simulates a run at the
    share its counters show."""
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}, "acceptance_rate": 0.8}
    always, half = _sim_run(spec, 4, 1), _sim_run({**spec, "proposal_rate": 0.5}, 4, 1)
    off = _sim_run({}, 4, 1)
    assert always.metrics.spec_proposal_perc == 100
    assert half.metrics.spec_proposal_perc == pytest.approx(50, abs=6)
    assert off.metrics.output_throughput < half.metrics.output_throughput < always.metrics.output_throughput
    never = _sim_run({**spec, "proposal_rate": 0.0}, 4, 1)
    assert never.metrics.spec_tokens_per_draft is None and never.metrics.spec_proposal_perc == 0


def test_the_simulator_asks_for_an_acceptance_rate() -> None:
    with pytest.raises(ConfigError, match="needs an acceptance rate"):
        _sim_run({"speculative_config": NGRAM}, 2, 1)
