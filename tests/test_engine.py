"""The engine on the real model: batching, preemption, chunking, prefix caching and the static
policy all give each request the tokens it gets alone; sampling; stop rules; API errors."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from inflight import ConfigError, FinishReason, InvalidRequestError, SamplingParams

SYSTEM = ("You are a careful assistant for a library. You answer questions about opening hours, "
          "loans, renewals and the reading room. Keep answers short and polite. ") * 3


def mixed_workload():
    prompts = PROMPTS + [SYSTEM + "When does the library open?", SYSTEM + "How do I renew a loan?"]
    lengths = [5, 24, 9, 17, 3, 12, 20, 8, 14]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    return prompts, params


_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def alone(make_llm):
    llm = make_llm()
    prompts, params = mixed_workload()
    return [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]


@pytest.mark.parametrize("options", [
    pytest.param({"max_num_tokens": 2048}, id="batched"),
    pytest.param({"max_num_tokens": 24, "max_batch_size": 4}, id="tiny-budget-chunks"),
    pytest.param({"num_kv_blocks": 20, "block_size": 16, "max_num_tokens": 512}, id="tiny-pool-preempts"),
    pytest.param({"scheduling_policy": "static", "max_batch_size": 4}, id="static"),
    pytest.param({"enable_chunked_prefill": False, "max_num_tokens": 256}, id="unchunked"),
    # Speculative decoding: every n-gram proposal verified (adaptive off), in a roomy step, in
    # tiny budgets, and in a pool so small that requests are preempted.
    pytest.param({"max_num_tokens": 2048, "speculative_config": _NGRAM}, id="speculative"),
    pytest.param({"max_num_tokens": 24, "max_batch_size": 4, "speculative_config": _NGRAM},
                 id="speculative-tiny-budget"),
    pytest.param({"num_kv_blocks": 12, "block_size": 16, "max_num_tokens": 512, "speculative_config": _NGRAM},
                 id="speculative-tiny-pool"),
])
def test_batched_tokens_equal_tokens_alone(make_llm, alone, options):
    llm = make_llm(**options)
    prompts, params = mixed_workload()
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    steps = list(llm.engine.step_records)
    assert max(s.num_requests for s in steps) > 1
    engine = llm.engine
    assert engine.block_manager.num_used_blocks == 0
    if options.get("num_kv_blocks") in (12, 20):
        assert engine.scheduler.num_preemptions > 0
        assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    if options.get("max_num_tokens") == 24:
        assert all(s.num_prefill_tokens + s.num_decode_tokens + s.num_spec_tokens <= 24 for s in steps)
    if "speculative_config" in options:
        stats = engine.stats()
        assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
        assert sum(s.num_spec_tokens for s in steps) == stats.spec_num_draft_tokens
    if options.get("scheduling_policy") == "static":
        assert sum(s.num_wasted_tokens for s in steps) > 0


@pytest.mark.parametrize("options,others", [
    pytest.param({}, PROMPTS[:6], id="batched"),
    pytest.param({"max_num_tokens": 64}, [], id="chunked"),
    pytest.param({"max_num_tokens": 100, "max_batch_size": 3}, PROMPTS[:4], id="batched-and-chunked"),
])
def test_a_long_requests_logprobs_are_its_own_bit_for_bit(make_llm, options, others):
    """A request of a 430-token prompt (long enough that attention splits its context over the
    threads) gets the same logprobs, bit for bit, batched with others or chunked as it is alone."""
    prompt = (PROMPTS[-1] + " ") * 3
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)

    def logprobs(llm, prompts):
        return [(t.token_id, t.logprob, t.top) for t in llm.generate(prompts, params)[0].logprobs or []]

    alone = logprobs(make_llm(), [prompt])
    assert len(alone) == 24
    llm = make_llm(**options)
    assert logprobs(llm, [prompt, *others]) == alone
    if others:
        assert max(s.num_requests for s in llm.engine.step_records) > 1


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_pool_gives_each_request_its_tokens_alone(make_llm, kv_dtype):
    """`kv_cache_dtype`: half the pool's bytes; each request still gets the tokens it gets alone
    (every step reads K/V as the pool holds them: chunks, batches and preemption change nothing),
    and the model's log-probabilities stay near the fp32 pool's (measured on the embedded model:
    bf16 0.006 nats on average, at most 0.07; fp16 0.0006 and 0.005)."""
    prompts, params = mixed_workload()
    llm = make_llm(kv_cache_dtype=kv_dtype)
    pool = llm.engine.runner.kv_cache
    assert pool.dtype == getattr(torch, kv_dtype) and pool.element_size() == 2
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    for options in ({"max_num_tokens": 24, "max_batch_size": 4}, {"num_kv_blocks": 20, "max_num_tokens": 512}):
        crowded = make_llm(kv_cache_dtype=kv_dtype, **options)
        assert [o.token_ids for o in crowded.generate(prompts, params)] == alone
        assert crowded.engine.block_manager.num_used_blocks == 0
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    fp32 = [[lp.logprob for lp in o.prompt_logprobs] for o in make_llm().generate(prompts, scored)]
    narrow = [[lp.logprob for lp in o.prompt_logprobs] for o in llm.generate(prompts, scored)]
    diffs = [abs(a - b) for x, y in zip(fp32, narrow, strict=True) for a, b in zip(x, y, strict=True)]
    bound = 0.03 if kv_dtype == "bfloat16" else 0.003
    assert 0 < sum(diffs) / len(diffs) < bound and max(diffs) < 10 * bound


def test_shared_prefix_hits_the_cache(make_llm, alone):
    llm = make_llm(max_num_tokens=2048)
    prompts, params = mixed_workload()
    llm.generate(prompts[-2], params[-2])
    out = llm.generate(prompts[-1], params[-1])[0]
    assert out.num_cached_tokens >= 16 * (len(llm.tokenizer.encode(SYSTEM)) // 16 - 1)
    assert out.token_ids == alone[-1]


def test_seeded_sampling_same_alone_and_batched(make_llm):
    llm = make_llm()
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate(PROMPTS[4], seeded)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0)
    batch = llm.generate([PROMPTS[0], PROMPTS[4], PROMPTS[1]], [others, seeded, others])
    assert batch[1].token_ids == alone
    again = llm.generate(PROMPTS[4], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert again[0].token_ids != alone  # the seed matters


def test_stop_strings_and_stop_tokens(make_llm):
    llm = make_llm()
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[4], greedy)[0]
    words = full.text.split()
    stop_word = words[len(words) // 2]
    cut = llm.generate(PROMPTS[4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop_word,)))[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop_word)]
    stop_id = full.token_ids[5]
    by_id = llm.generate(PROMPTS[4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                    stop_token_ids=(stop_id,)))[0]
    assert by_id.finish_reason is FinishReason.STOP
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_eos_ends_a_request_unless_ignored(make_llm):
    llm = make_llm()
    chat = [{"role": "user", "content": "Say hello."}]
    out = llm.generate(chat, SamplingParams(max_tokens=200, temperature=0))[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text
    forced = llm.generate(chat, SamplingParams(max_tokens=len(out.token_ids) + 5, temperature=0, ignore_eos=True))[0]
    assert forced.finish_reason is FinishReason.LENGTH and len(forced.token_ids) == len(out.token_ids) + 5


def test_chat_takes_a_conversation_or_several_as_vllm_does(make_llm):
    llm = make_llm()
    greet = [{"role": "user", "content": "Say hello."}]
    ask = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}]
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = llm.chat(greet, params)
    both = llm.chat([greet, ask], params)
    assert [o.token_ids for o in alone] == [both[0].token_ids] == [llm.generate(greet, params)[0].token_ids]
    assert both[1].token_ids == llm.generate(ask, params)[0].token_ids
    assert both[0].prompt_token_ids != both[1].prompt_token_ids
    with pytest.raises(ValueError, match="conversation"):
        llm.chat(["Say hello."], params)


def test_generate_takes_vllms_prompt_dicts(make_llm):
    """vLLM's TextPrompt and TokensPrompt ({"prompt": ...}, {"prompt_token_ids": ...}), alone or in
    a list: the same outputs as the text or ids themselves; another key is refused by name."""
    llm = make_llm()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    text = llm.generate(PROMPTS[0], params)[0]
    ids = llm.generate(text.prompt_token_ids, params)[0]
    assert llm.generate({"prompt": PROMPTS[0]}, params)[0].token_ids == text.token_ids
    both = llm.generate([{"prompt": PROMPTS[1]}, {"prompt_token_ids": text.prompt_token_ids}], params)
    assert both[0].token_ids == llm.generate(PROMPTS[1], params)[0].token_ids
    assert both[1].token_ids == ids.token_ids and both[1].prompt_token_ids == text.prompt_token_ids
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPTS[0], "multi_modal_data": {}}, params)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": "not ids"}], params)
    assert not llm.engine.has_unfinished()  # a refused batch adds none of its prompts


def test_vllms_quickstart_loop_reads_the_outputs(make_llm):
    """vLLM's quickstart (`output.prompt`, `output.outputs[0].text`) over inflight's outputs: each
    one is also the `RequestOutput` of its sample; with n > 1 each sample is listed apart."""
    llm = make_llm()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = llm.generate([PROMPTS[0], {"prompt": PROMPTS[1]}], params)
    alone = [llm.generate(p, params)[0].text for p in PROMPTS[:2]]
    assert [(o.prompt, o.outputs[0].text, o.finished) for o in outputs] == \
        [(PROMPTS[0], alone[0], True), (PROMPTS[1], alone[1], True)]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].prompt is None  # token ids, as vLLM's
    samples = llm.generate(PROMPTS[2], SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=1))
    assert [(o.prompt, o.index) for o in samples] == [(PROMPTS[2], 0), (PROMPTS[2], 1)]


def test_penalties_change_repetitive_output(make_llm):
    llm = make_llm()
    prompt = "one one one one one one one one"
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    penalised = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    frequency_penalty=2.0, presence_penalty=2.0,
                                                    repetition_penalty=1.5))[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_min_tokens_hold_back_eos_and_stops(make_llm):
    llm = make_llm()
    chat = [{"role": "user", "content": "Say hello."}]
    free = llm.generate(chat, SamplingParams(max_tokens=200, temperature=0))[0]
    assert free.finish_reason is FinishReason.STOP
    n = len(free.token_ids)
    held = llm.generate(chat, SamplingParams(max_tokens=n + 40, temperature=0, min_tokens=n + 4))[0]
    assert len(held.token_ids) >= n + 4
    assert not set(held.token_ids[:n + 4]) & llm.tokenizer.eos_token_ids
    assert held.token_ids[:n - 1] == free.token_ids[:n - 1]  # the same text up to where EOS came
    # A stop string is not searched for before min_tokens either; after it, it is again.
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(PROMPTS[4], greedy)[0]
    word = full.text.split()[2]
    early = llm.generate(PROMPTS[4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(word,)))[0]
    late = llm.generate(PROMPTS[4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(word,),
                                                   min_tokens=len(early.token_ids) + 2))[0]
    assert len(late.token_ids) > len(early.token_ids) + 1 and late.text.startswith(early.text + word)
    assert late.finish_reason is FinishReason.STOP or len(late.token_ids) == 40


def test_logit_bias_moves_even_greedy_choices(make_llm):
    llm = make_llm()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    free = llm.generate(PROMPTS[0], greedy)[0]
    forced_id = 1234
    forced = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                     logit_bias={forced_id: 100}))[0]
    assert forced.token_ids == [forced_id] * 6
    banned = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                     logit_bias={free.token_ids[0]: -100}))[0]
    assert banned.token_ids[0] != free.token_ids[0]
    # Next to unbiased requests in one batch, only the biased row moves.
    biased = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced_id: 100})
    both = llm.generate([PROMPTS[0], PROMPTS[0]], [greedy, biased])
    assert both[0].token_ids == free.token_ids and both[1].token_ids == [forced_id] * 6


def test_min_p_of_one_samples_the_most_likely_token(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    only_top = SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True, min_p=1.0, seed=7)
    assert llm.generate(PROMPTS[1], only_top)[0].token_ids == greedy.token_ids
    loose = [llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=1.5, ignore_eos=True, min_p=0.01,
                                                      seed=s))[0].token_ids for s in range(3)]
    assert any(t != greedy.token_ids for t in loose)


def test_abort_frees_kv(make_llm):
    llm = make_llm()
    engine = llm.engine
    request = engine.add_request(PROMPTS[6], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort(request.request_id)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    assert request.finish_reason is FinishReason.ABORT


def test_request_timings_are_recorded(make_llm):
    llm = make_llm()
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    t = out.timings
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert len(t.token_times) == 6 and t.token_times == sorted(t.token_times)


def test_failed_step_fails_only_its_requests(make_llm):
    llm = make_llm()
    engine = llm.engine
    victim = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))

    def boom(out):
        engine.runner.before_forward = None
        raise RuntimeError("injected fault")

    engine.runner.before_forward = boom
    outputs = engine.step()
    assert [o.request_id for o in outputs] == [victim.request_id] and outputs[0].error
    assert victim.finish_reason is FinishReason.ERROR and engine.num_failed_steps == 1
    assert engine.block_manager.num_used_blocks == 0
    after = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(after.token_ids) == 4


@pytest.mark.parametrize("bad", [
    {"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
    {"repetition_penalty": 0}, {"presence_penalty": 3}, {"stop": ("",)},
    {"min_tokens": -1}, {"min_tokens": 17}, {"min_p": 1.5}, {"logit_bias": {5: 101}}, {"logit_bias": {-1: 1}},
])
def test_invalid_sampling_params(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_sampling_params_take_vllms_none_and_top_k_off():
    """vLLM's SamplingParams takes None for no stop strings, stop tokens or bias, and top_k -1
    for off (its default before 0): code written for it builds the same params here."""
    params = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None, top_k=-1, temperature=0.7)
    assert params == SamplingParams(temperature=0.7)
    assert (params.stop, params.stop_token_ids, params.logit_bias, params.top_k) == ((), (), (), 0)


def test_max_tokens_none_runs_to_the_end_of_the_context(make_llm):
    """vLLM's max_tokens=None: the output may run to max_model_len (the engine sets the request's
    max_tokens when it queues it); a prompt that fills the context is refused in one line."""
    llm = make_llm(max_model_len=48)
    prompt = llm.engine.tokenize("The capital of France is", None)
    out = llm.generate(prompt, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 48 - len(prompt) and out.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(list(range(100, 148)), SamplingParams(max_tokens=None))
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None
    assert llm.engine.block_manager.num_used_blocks == 0


def test_invalid_requests_are_rejected(make_llm):
    llm = make_llm(max_model_len=64)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("")
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("word " * 100)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 2, 10**9])
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_invalid_engine_options(make_llm):
    with pytest.raises(ConfigError, match="unknown engine option"):
        make_llm(max_batch=3)
    with pytest.raises(ConfigError):
        make_llm(block_size=0)
