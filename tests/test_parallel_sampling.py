"""n > 1: one prefill, the prompt's KV blocks forked with reference counts and the last one
copied on write, each sample then a request of its own (scheduled, preempted, aborted and
finished alone), reproducible with a seed and different from one another."""

from __future__ import annotations

import pytest

from inflight import SamplingParams
from inflight.errors import InvalidRequestError

PROMPT = list(range(1000, 1256))  # 256 tokens: 16 full blocks of 16


def sampled(n: int, seed: int = 3, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True)


def test_n_samples_share_one_prefill_and_the_prompts_blocks(make_llm):
    llm = make_llm(num_kv_blocks=512)
    engine, bm = llm.engine, llm.engine.block_manager
    outs = llm.generate([PROMPT], sampled(8))
    assert [o.index for o in outs] == list(range(8)) and all(len(o.token_ids) == 8 for o in outs)
    steps = list(engine.step_records)
    assert steps[0].num_prefill_tokens == 256  # the one prefill
    assert steps[1].num_prefill_tokens == 7  # each other sample computes the last prompt token itself
    forked_peak = bm.peak_used_blocks
    assert bm.num_used_blocks == 0
    bm.check_invariants()
    separate = make_llm(num_kv_blocks=512, enable_prefix_caching=False)
    separate.generate([PROMPT] * 8, [sampled(1, seed=s) for s in range(8)])
    # 16 shared prompt blocks plus a copy and a new block per sample, against 17 blocks each.
    assert forked_peak <= 16 + 2 * 8 < separate.engine.block_manager.peak_used_blocks // 4
    again = llm.generate([PROMPT], sampled(8))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs], "a seed reproduces the samples"
    assert len({tuple(o.token_ids) for o in outs}) == 8, "the samples differ from one another"


def test_each_sample_is_aborted_and_preempted_on_its_own(make_llm):
    llm = make_llm(num_kv_blocks=512)
    engine = llm.engine
    parent = engine.add_request(PROMPT[:40], sampled(4, max_tokens=50))
    engine.step()
    engine.step()
    samples = [parent, *parent.samples]
    assert len(samples) == 4 and engine.num_running == 4
    assert engine.abort(samples[2].request_id) and engine.num_running == 3
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output_token_ids) for r in samples] == [50, 50, len(samples[2].output_token_ids), 50]
    assert engine.block_manager.num_used_blocks == 0
    # Aborted before its prefill, a request never forks.
    early = engine.add_request(PROMPT[:40], sampled(4))
    assert engine.abort(early.request_id) and not early.samples and engine.block_manager.num_used_blocks == 0
    # A pool too small for all samples at once: they are preempted and recomputed, and all end.
    tight = make_llm(num_kv_blocks=20, block_size=16)
    outs = tight.generate([PROMPT[:100]], sampled(4, max_tokens=120))
    assert tight.engine.scheduler.num_preemptions > 0
    assert [len(o.token_ids) for o in outs] == [120] * 4
    assert tight.engine.block_manager.num_used_blocks == 0
    tight.engine.block_manager.check_invariants()


def test_n_is_checked(make_llm):
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=0)
    llm = make_llm(max_batch_size=4)
    with pytest.raises(InvalidRequestError, match="max_batch_size"):
        llm.generate(["hi"], SamplingParams(n=5))
    static = make_llm(scheduling_policy="static")
    with pytest.raises(InvalidRequestError, match="continuous or priority"):
        static.generate(["hi"], SamplingParams(n=2))


def test_a_disconnect_aborts_every_sample(loaded):
    import time

    import httpx

    from inflight import EngineConfig, LLMEngine
    from inflight.server.config import ServerConfig
    from inflight.server.launcher import serve_in_thread

    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=256), loaded)
    with serve_in_thread(engine, ServerConfig(shutdown_timeout_s=5)) as running:
        body = {"model": engine.model_name, "prompt": "Tell me a story.", "max_tokens": 400, "n": 4,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as r:
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.add(line.split('"index":')[1].split(",")[0])
                if len(seen) == 4:
                    break  # every sample has started: leave
        deadline = time.monotonic() + 20
        while (engine.has_unfinished() or engine.block_manager.num_used_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0
