"""The FastAPI app: routes, API-key check, body limits, and the engine's lifecycle."""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from inflight.server.async_engine import AsyncEngine
from inflight.server.config import ServerConfig
from inflight.server.errors import APIError, from_validation_error, install_error_handlers
from inflight.server.metrics import ServerMetrics
from inflight.server.openapi import ERROR_RESPONSES, ServedLimits, build_openapi, json_body, sse_ok
from inflight.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from inflight.server.serving import OpenAIServing

logger = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)


async def read_raw_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; 413 past `max_bytes` (declared or actually sent, so a chunked upload
    cannot dodge the limit)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, model: type[_Body], max_bytes: int) -> _Body:
    """Parses a JSON body into `model`: 413 past `max_bytes`, 400 for anything malformed.
    pydantic's own JSON parser refuses what `json.loads` would let through to fail later: lone
    surrogates (which the tokenizer cannot encode) and nesting deep enough to exhaust the Python
    stack."""
    body = await read_raw_body(request, max_bytes)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc.errors(include_input=False)) from None


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`; the engine loop starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    metrics = ServerMetrics(lambda: engine.stats, engine.ttft_target_s, engine.tpot_target_s,
                            engine.cache_config_info)
    engine.add_step_observer(metrics.observe_step)
    serving = OpenAIServing(engine, metrics, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # `GracefulServer` has normally drained already; other hosts get the same drain here.
        await engine.drain(config.shutdown_timeout_s)
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="inflight", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = engine
    app.state.metrics = metrics
    install_error_handlers(app, on_error=metrics.count_refused)

    async def check_access(request: Request) -> None:
        if config.api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            # compare_digest: the time taken must not tell how much of a guessed key was right.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
                raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
        if not engine.is_accepting:
            raise APIError(503, "the server is shutting down")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_access)])

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest),
             responses={**sse_ok(CompletionResponse), **ERROR_RESPONSES})
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, config.max_body_bytes)
        return await serving.completion(body, request)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
             responses={**sse_ok(ChatCompletionResponse), **ERROR_RESPONSES})
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, config.max_body_bytes)
        return await serving.chat(body, request)

    @v1.get("/models", responses={401: ERROR_RESPONSES[401], 503: ERROR_RESPONSES[503]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=serving.model_name, max_model_len=engine.max_model_len)])

    app.include_router(v1)
    # vLLM's token utilities, at the root as vLLM serves them (behind the same key).
    utils = APIRouter(dependencies=[Depends(check_access)])

    @utils.post("/tokenize", openapi_extra=json_body(TokenizeRequest), response_model=TokenizeResponse,
                responses=ERROR_RESPONSES)
    async def tokenize(request: Request) -> TokenizeResponse:
        return await serving.tokenize(await read_body(request, TokenizeRequest, config.max_body_bytes))

    @utils.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), response_model=DetokenizeResponse,
                responses=ERROR_RESPONSES)
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await serving.detokenize(await read_body(request, DetokenizeRequest, config.max_body_bytes))

    app.include_router(utils)

    @app.get("/health", responses={200: {"description": '{"status": "ok"}'},
                                   503: {"description": '{"status": "unavailable"} while shutting down'}})
    async def health() -> Response:
        if not engine.is_accepting:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version", responses={200: {"description": '{"version": "0.1.0"}'}})
    async def version() -> Response:  # vLLM's, which some clients read to tell the server apart
        return JSONResponse({"version": importlib.metadata.version("inflight")})

    @app.get("/metrics", responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    limits = ServedLimits(serving.model_name, engine.max_model_len, engine.max_prompt_chars, engine.vocab_size)

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(
                app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest], limits)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
