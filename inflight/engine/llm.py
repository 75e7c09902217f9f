"""The offline API: `LLM(model=..., **options).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inflight.config import EngineConfig
from inflight.engine.engine import LLMEngine
from inflight.model.loaded import LoadedModel
from inflight.model.tokenizer import ChatMessage
from inflight.request import FinishReason, RequestTimings, SamplingParams, TokenLogprobs

# A string, token ids, a chat conversation, or vLLM's prompt dicts: {"prompt": text} (its
# TextPrompt) or {"prompt_token_ids": ids} (its TokensPrompt).
Prompt = str | Sequence[int] | Sequence[ChatMessage] | Mapping[str, Any]


@dataclass(frozen=True)
class CompletionOutput:
    """The result of one prompt (of one sample of it, with SamplingParams(n > 1)). It also reads as
    vLLM's `RequestOutput` of that one sample (`prompt`, `outputs`, `finished`), so that vLLM's
    loop, `for output in llm.generate(...): output.outputs[0].text`, runs as it is; where vLLM
    groups a prompt's n samples in one `RequestOutput`, inflight lists each apart."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_preemptions: int
    num_cached_tokens: int
    timings: RequestTimings
    index: int = 0  # which sample of its prompt, with SamplingParams(n > 1)
    logprobs: list[TokenLogprobs] | None = None  # one per token, with SamplingParams(logprobs=k)
    # One per prompt token after the first, with SamplingParams(prompt_logprobs=k).
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt: str | None = None  # the prompt where it was given as text (else None, as vLLM's)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's `RequestOutput.outputs`: this sample."""
        return [self]

    @property
    def finished(self) -> bool:
        """vLLM's `RequestOutput.finished`: `generate` returns finished requests only."""
        return True


class LLM:
    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **options), loaded)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's call of that name: the model's sampling defaults (its generation config, unless
        `generation_config="vllm"`) over SamplingParams' own."""
        return self.engine.sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[CompletionOutput]:
        """Runs every prompt to completion, all in one continuous batch. A prompt is a string,
        a list of token ids, a chat conversation (a list of {"role", "content"} dicts), or one of
        vLLM's prompt dicts: {"prompt": text} or {"prompt_token_ids": ids}.
        Without `params`, the model's own sampling defaults (its generation config; vLLM's
        `get_default_sampling_params`). `priority`: one for all prompts or one each (lower is more
        urgent; the priority scheduling policy only)."""
        batch = [prompts] if _is_single(prompts) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.engine.sampling_params()] * len(batch)
        else:
            param_list = list(params)
            if len(param_list) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(param_list)} SamplingParams")
        priorities = [priority] * len(batch) if isinstance(priority, int) else list(priority)
        if len(priorities) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(priorities)} priorities")
        engine = self.engine
        batch = [_unwrap(prompt) for prompt in batch]  # checked before any is added
        requests = []
        for prompt, p, rank in zip(batch, param_list, priorities, strict=True):
            if _is_chat(prompt):
                requests.append(engine.add_request(params=p, messages=prompt, priority=rank))  # type: ignore[arg-type]
            else:
                requests.append(engine.add_request(prompt, p, priority=rank))  # type: ignore[arg-type]
        mine = {r.request_id for r in requests}
        given = {r.request_id: prompt for r, prompt in zip(requests, batch, strict=True) if isinstance(prompt, str)}
        texts: dict[str, str] = {}
        while engine.has_unfinished():
            for out in engine.step():
                parent = out.request_id.split("#")[0]  # a sample's id extends its prompt's (n > 1)
                if parent in mine:
                    texts[out.request_id] = texts.get(out.request_id, "") + out.text
        # With n > 1 each prompt's samples follow it, in order.
        requests = [sample for r in requests for sample in (r, *r.samples)]
        return [
            CompletionOutput(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                text=texts.get(r.request_id, ""),
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason or FinishReason.ABORT,
                num_preemptions=r.num_preemptions,
                num_cached_tokens=r.num_cached_tokens,
                timings=r.timings,
                index=r.sample_index,
                logprobs=list(r.output_logprobs) if r.sampling_params.logprobs is not None else None,
                prompt_logprobs=list(r.prompt_logprobs) if r.sampling_params.prompt_logprobs is not None else None,
                prompt=given.get(r.request_id.split("#")[0]),
            )
            for r in requests
        ]

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: int | Sequence[int] = 0,
    ) -> list[CompletionOutput]:
        """vLLM's offline `chat`: `generate` for one conversation (a list of {"role", "content"}
        dicts, rendered by the model's chat template) or a list of them."""
        conversations = [messages] if _is_chat(messages) else list(messages)
        if not all(_is_chat(c) for c in conversations):
            raise ValueError("chat takes a conversation (a list of {'role', 'content'} dicts) or a list of them")
        return self.generate(conversations, params, priority)  # type: ignore[arg-type]


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) \
        and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def _unwrap(prompt: Any) -> Any:
    """The text or token ids of vLLM's prompt dicts (TextPrompt, TokensPrompt); any other prompt
    as it is. A dict with another key (multi-modal data, embeddings) is refused by name."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    ids = prompt.get("prompt_token_ids")
    if keys == {"prompt_token_ids"} and isinstance(ids, Sequence) and not isinstance(ids, str) \
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return list(ids)
    if keys - {"prompt", "prompt_token_ids"}:
        raise ValueError(f"a prompt dict with {', '.join(sorted(keys - {'prompt', 'prompt_token_ids'}))}: "
                         "inflight takes {'prompt': text} or {'prompt_token_ids': [ids]} (text only)")
    raise ValueError("a prompt dict holds one of 'prompt' (a string) or 'prompt_token_ids' (a list of ints)")


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str | Mapping) or _is_chat(prompts):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
