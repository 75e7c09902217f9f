"""inflight's logits and greedy tokens against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from inflight import SamplingParams
from inflight.model.token_ops import TorchTokenOps

NUM_TOKENS = 32
# fp32 on both sides; the remaining differences are summation order in matmuls and attention.
LOGITS_ATOL = 2e-3

CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


def prompt_ids(loaded, prompt) -> list[int]:
    if isinstance(prompt, list):
        return loaded.tokenizer.apply_chat_template(prompt)
    return loaded.tokenizer.encode(prompt)


def all_prompts():
    return PROMPTS + [CHAT]


@pytest.fixture(scope="module")
def reference(loaded, request):
    """For each prompt: (prompt ids, HF greedy continuation, HF logits at every step), computed by
    transformers once for these prompts and weights (tests/hf_reference.py keeps it)."""
    from hf_reference import cached

    prompts = [prompt_ids(loaded, prompt) for prompt in all_prompts()]

    def compute():
        hf_model = request.getfixturevalue("hf_model")
        results = []
        with torch.inference_mode():
            for ids in prompts:
                out = hf_model(input_ids=torch.tensor([ids]), use_cache=True)
                past, step_logits, tokens = out.past_key_values, [out.logits[0, -1]], []
                for _ in range(NUM_TOKENS):
                    token = int(step_logits[-1].argmax())
                    tokens.append(token)
                    out = hf_model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    step_logits.append(out.logits[0, -1])
                results.append((ids, tokens, torch.stack(step_logits[:NUM_TOKENS]).clone()))
        return results

    return cached("greedy", [prompts, NUM_TOKENS], compute)


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


def test_logits_match_reference(loaded, reference):
    from inflight.engine.block_manager import BlockManager
    from inflight.engine.runner import ModelRunner
    from inflight.engine.sampler import Sampler
    from inflight.engine.scheduler import ScheduledRequest
    from inflight.request import Request

    runner = ModelRunner(loaded.model, 256, 16, Sampler(torch.device("cpu")))
    bm = BlockManager(256, 16)
    for i, (ids, tokens, ref_logits) in enumerate(reference):
        req = Request(f"r{i}", ids, GREEDY)
        sequence = ids + tokens
        # Prefill the prompt, then feed the reference tokens one by one (teacher forcing).
        start = 0
        for end in [len(ids)] + list(range(len(ids) + 1, len(sequence) + 1))[: NUM_TOKENS - 1]:
            req.output_token_ids = tokens[: end - len(ids)]
            assert bm.allocate_slots(req, end)
            inputs = runner.prepare([ScheduledRequest(req, start, end - start, bm.block_table(req.request_id))])
            logits = loaded.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches,
                                          inputs.attn_meta, inputs.logits_indices)
            step = end - len(ids)
            torch.testing.assert_close(logits[0], ref_logits[step], atol=LOGITS_ATOL, rtol=0)
            start = end
        bm.free(req.request_id)


def test_greedy_alone_matches_reference(make_llm, reference):
    llm = make_llm()
    for prompt, (_, tokens, _) in zip(all_prompts(), reference, strict=True):
        [out] = llm.generate([prompt], GREEDY)
        assert out.token_ids == tokens, f"prompt {prompt!r}"


def test_greedy_packed_matches_reference(make_llm, reference):
    llm = make_llm(max_num_tokens=4096)
    outs = llm.generate(all_prompts(), GREEDY)
    for out, (_, tokens, _) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens
    steps = list(llm.engine.step_records)
    assert steps[0].num_requests == len(all_prompts()), "all prompts should be packed into the first step"


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
def test_greedy_chunked_prefill_matches_reference(make_llm, reference, chunk):
    llm = make_llm(max_num_tokens=chunk, max_batch_size=1, enable_chunked_prefill=True)
    # Small chunks mean many steps: a subset (short, code, non-English, long, chat) keeps it quick.
    chosen = range(len(all_prompts())) if chunk >= 100 else [0, 1, 3, 6, len(PROMPTS)]
    if chunk == 1:
        chosen = [0, 3, len(PROMPTS)]
    prompts = [all_prompts()[i] for i in chosen]
    refs = [reference[i] for i in chosen]
    outs = llm.generate(prompts, GREEDY)
    for out, (_ids, tokens, _) in zip(outs, refs, strict=True):
        assert out.token_ids == tokens
    if chunk < max(len(ids) for ids, _, _ in refs):
        assert max(r.num_prefill_tokens for r in llm.engine.step_records) == chunk


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_results_do_not_depend_on_block_size(make_llm, reference, block_size):
    llm = make_llm(block_size=block_size, num_kv_blocks=8192 // block_size, max_num_tokens=4096)
    outs = llm.generate(all_prompts(), GREEDY)
    for out, (_, tokens, _) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens


def test_results_do_not_depend_on_physical_blocks(make_llm, reference):
    import random
    from collections import OrderedDict

    llm = make_llm(block_size=4, num_kv_blocks=1024, max_num_tokens=4096, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    order = list(range(bm.num_blocks))
    random.Random(0).shuffle(order)
    bm._free = OrderedDict.fromkeys(order)
    outs = llm.generate(all_prompts(), GREEDY)
    for out, (_, tokens, _) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens
    tables_were_scattered = order[:4] != [0, 1, 2, 3]
    assert tables_were_scattered


def test_pytorch_path_matches_reference(loaded, make_llm, reference):
    """The same greedy tokens without the compiled CPU kernels, attention and token-wise ops
    both in plain PyTorch (the portable path other devices take)."""
    model, attention = loaded.model, loaded.model.attention
    cfg = model.config
    kernel, attention.kernels = attention.kernels, None
    ops, model.ops = model.ops, TorchTokenOps(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
    stack, model.decoder_stack = model.decoder_stack, None
    try:
        llm = make_llm(max_num_tokens=4096)
        outs = llm.generate(all_prompts(), GREEDY)
    finally:
        attention.kernels, model.ops, model.decoder_stack = kernel, ops, stack
    for out, (_, tokens, _) in zip(outs, reference, strict=True):
        assert out.token_ids == tokens


def _check_logprobs(out, ref_tokens, ref_logits, k: int) -> None:
    """inflight's logprobs of a greedy output against transformers' log-softmax at each step."""
    assert out.token_ids == ref_tokens and len(out.logprobs) == len(ref_tokens)
    ref = ref_logits.float().log_softmax(dim=-1)
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == ref_tokens[step]
        assert abs(lp.logprob - float(ref[step, lp.token_id])) < 1e-4
        top_values, top_ids = ref[step].topk(k)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top_values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [{}, {"max_num_tokens": 16, "enable_chunked_prefill": True}],
                         ids=["whole", "chunked"])
def test_logprobs_match_reference(make_llm, reference, options):
    """The raw distribution's log-probabilities, alone and packed beside requests that ask for
    none, also where the prompt's blocks are prefix-cache hits."""
    llm = make_llm(max_num_tokens=options.get("max_num_tokens", 4096),
                   enable_chunked_prefill=options.get("enable_chunked_prefill", True))
    asking = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    prompts = all_prompts()
    params = [asking if i % 2 == 0 else GREEDY for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    for i, (out, (_, tokens, logits)) in enumerate(zip(outs, reference, strict=True)):
        if i % 2 == 0:
            _check_logprobs(out, tokens, logits, 5)
        else:
            assert out.logprobs is None and out.token_ids == tokens
    again = llm.generate(prompts[0], asking)[0]  # its prompt's full blocks are cached now
    assert again.num_cached_tokens > 0 or len(again.prompt_token_ids) < 32
    _check_logprobs(again, reference[0][1], reference[0][2], 5)


@pytest.mark.parametrize("options", [{}, {"max_num_tokens": 7, "enable_chunked_prefill": True}],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_match_reference(make_llm, loaded, hf_model, options):
    """lm-eval's loglikelihood: every prompt token's log-probability after the first, also for a
    prompt whose blocks are already in the prefix cache (they are computed again, not skipped)."""
    llm = make_llm(**options)
    prompts = [prompt_ids(loaded, p) for p in (PROMPTS[3], CHAT)] + [list(range(500, 540))]
    for ids in prompts:
        llm.generate(ids, SamplingParams(max_tokens=2, temperature=0))  # fills the prefix cache
        out = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
        assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(ids) - 1
        with torch.inference_mode():
            ref = hf_model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
        for q, lp in enumerate(out.prompt_logprobs):
            assert lp.token_id == ids[q + 1]
            assert abs(lp.logprob - float(ref[q, ids[q + 1]])) < 1e-4
            assert [t for t, _ in lp.top] == ref[q].topk(2).indices.tolist()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption(make_llm):
    prompts = [list(range(600 + 50 * i, 640 + 50 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=0)
    alone = [make_llm().generate(p, params)[0].prompt_logprobs for p in prompts]
    tight = make_llm(num_kv_blocks=16, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outs, alone, strict=True):
        assert len(out.prompt_logprobs) == 39
        assert [lp.token_id for lp in out.prompt_logprobs] == [lp.token_id for lp in ref]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.prompt_logprobs]),
                                   torch.tensor([lp.logprob for lp in ref]), atol=1e-5, rtol=0)
