"""The published OpenAPI schema (`GET /openapi.json`).

The generation routes read their JSON bodies themselves (to bound their size before parsing),
so FastAPI cannot see the request models; they are added here, with the limits of this very
server (its model name, its context length), so that a client generator or a fuzzer sees the
inputs the server really accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from inflight.request import LIMITS
from inflight.server.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"

# Every error a generation route can answer, each with an OpenAI error body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "body too large"), (429, "waiting queue full"), (500, "the engine step failed"),
        (503, "shutting down"),
    ]
}


# Body fields that carry a SamplingParams field under another name.
_SAMPLING_FIELD = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}


class ServedLimits(NamedTuple):
    model_name: str
    max_model_len: int
    max_prompt_chars: int
    vocab_size: int


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads a `model` from its JSON body itself."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def sse_ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events when the request streams."""
    # Before Open API 3.2, the schema of an event stream describes one event.
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE] last"}}}
    events = {"schema": event}
    return {200: {"model": model, "content": {"text/event-stream": events}}}


def build_openapi(app: FastAPI, bodies: Sequence[type[BaseModel]], limits: ServedLimits) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in bodies:
        body = model.model_json_schema(ref_template=_REF)
        components.update(body.pop("$defs", {}))
        components[model.__name__] = _with_limits(body, limits)
    return schema


def _with_request_limits(props: dict[str, Any]) -> None:
    """Each numeric field's range, as `SamplingParams` checks it (`inflight.request.LIMITS`)."""
    for name, prop in props.items():
        limit = LIMITS.get(_SAMPLING_FIELD.get(name, name))
        if limit is None:
            continue
        if name == "logit_bias":
            prop = prop["anyOf"][0]["additionalProperties"]
        else:
            prop = prop["anyOf"][0] if "anyOf" in prop else prop
        if prop.get("type") not in ("integer", "number"):
            continue  # chat's boolean `logprobs`
        bounds = {"minimum": limit.ge, "exclusiveMinimum": limit.gt, "maximum": limit.le}
        prop.update({k: v for k, v in bounds.items() if v is not None and k not in prop})


def _with_limits(body: dict[str, Any], limits: ServedLimits) -> dict[str, Any]:
    props = body["properties"]
    _with_request_limits(props)
    model = props["model"]  # optional: absent, null or "" is the served model; any other name gets 404
    (model["anyOf"][0] if "anyOf" in model else model)["enum"] = [limits.model_name, ""]
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:  # the prompt takes at least one token of the context
            props[name]["anyOf"][0]["maximum"] = limits.max_model_len - 1
    if "tokens" in props:  # /detokenize
        props["tokens"]["items"]["maximum"] = limits.vocab_size - 1
    if "prompt" in props and "oneOf" not in props["prompt"]:  # /tokenize: text only
        props["prompt"]["anyOf"][0]["maxLength"] = limits.max_prompt_chars
    elif "prompt" in props:
        text, token_ids, batch_of_texts, batch_of_token_ids = props["prompt"]["oneOf"]
        text["maxLength"] = batch_of_texts["items"]["maxLength"] = limits.max_prompt_chars
        for ids in (token_ids, batch_of_token_ids["items"]):
            ids["maxItems"] = limits.max_model_len - 1
            ids["items"]["maximum"] = limits.vocab_size - 1
    return body
