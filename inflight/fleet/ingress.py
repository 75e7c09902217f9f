"""The fleet's front door: one Ray Serve deployment that takes every HTTP request and forwards
it to an engine replica through a deployment handle, whose router picks the replica.

The ingress reads just enough of a request to route it: it tokenizes the prompt (or renders
the chat), exactly as the replica will, and passes the prompt's block keys along as the
call's `route` (`RouteHint`). It answers `/metrics` (every replica's series, labelled) and
`/health` itself; everything else, errors included, is the replica's answer, unchanged. If a
replica dies before its answer has begun, the request goes to another once; once a stream
has begun, it ends with an error event instead.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from inflight.engine.block_manager import block_hashes
from inflight.errors import InflightError
from inflight.fleet import metrics
from inflight.fleet.asgi import ForwardedRequest, ResponseStart, forwardable
from inflight.fleet.routing import RouteHint
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import Tokenizer
from inflight.server.app import read_raw_body
from inflight.server.config import ServerConfig
from inflight.server.errors import APIError, error_event
from inflight.server.protocol import ChatCompletionRequest, CompletionRequest
from inflight.server.serving import ClosingStreamingResponse

logger = logging.getLogger("ray.serve")

_DEAD = (RayActorError, ActorUnavailableError)  # the replica's process is gone or unreachable


def prompt_tokens(path: str, body: bytes, tokenizer: Tokenizer, chat_template: str | None) -> list[int] | None:
    """The token ids the replica will compute for this request (the first prompt of a batch),
    or None where the body is not a generation request (the replica will say what is wrong)."""
    try:
        if path == "/v1/completions":
            completion = CompletionRequest.model_validate_json(body)
            prompt = completion.prompts[0]
            return tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate_json(body)
            messages = [m.to_template() for m in chat.messages]
            return tokenizer.apply_chat_template(messages, True, chat.template_tools(), chat_template)
    except (ValidationError, InflightError, ValueError, IndexError):
        return None
    return None


class FleetIngress:
    def __init__(self, replicas: DeploymentHandle, model: str | None, block_size: int, server: ServerConfig,
                 board: Any = None) -> None:
        self.replicas = replicas
        self.tokenizer = Tokenizer.load(resolve_model(model))
        self.block_size = block_size
        self.chat_template = server.chat_template
        self.max_body_bytes = server.max_body_bytes
        self.api_key = server.api_key
        self._board = board  # the MetricsBoard actor, or None
        self.accepting = True
        self.num_active = 0

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    # --- control, called by the launcher ------------------------------------------------------

    async def drain(self, timeout_s: float) -> int:
        """Refuses new requests (503), waits up to `timeout_s` for the forwarded ones to end;
        returns how many had not."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.num_active

    # --- HTTP ---------------------------------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return Response(await self._metrics(), media_type=CONTENT_TYPE_LATEST)
        if not self.accepting:
            if path == "/health":
                return JSONResponse({"status": "unavailable"}, status_code=503)
            return APIError(503, "the server is shutting down").response()
        try:
            body = await read_raw_body(request, self.max_body_bytes)
        except APIError as exc:
            return exc.response()
        hint = None
        # Tokenizing costs time: only for requests the replica will not refuse at once (401).
        generation = request.method == "POST" and path in ("/v1/completions", "/v1/chat/completions")
        if generation and self._authorized(request):
            ids = await asyncio.to_thread(prompt_tokens, path, body, self.tokenizer, self.chat_template)
            if ids is not None:
                hint = RouteHint(len(ids), tuple(block_hashes(ids, self.block_size)), self.block_size)
        forwarded = ForwardedRequest(request.method, path, request.url.query.encode("latin-1"),
                                     forwardable(list(request.headers.items())), body)
        self.num_active += 1
        try:
            opened = await self._open(forwarded, hint)
        except BaseException:
            self.num_active -= 1
            raise
        if isinstance(opened, Response):
            self.num_active -= 1
            return opened
        start, responses = opened
        headers = dict(start.headers)
        if start.media_type != "text/event-stream":
            try:
                content = b"".join([piece async for piece in self._pieces(responses)])
            except _DEAD:
                return APIError(503, "the engine replica serving this request stopped; retry").response()
            finally:
                self.num_active -= 1
            return Response(content, status_code=start.status, headers=headers)
        return ClosingStreamingResponse(self._relay(responses), on_close=self._finished, status_code=start.status,
                                        headers=headers)

    def _finished(self) -> None:
        self.num_active -= 1

    async def _open(self, forwarded: ForwardedRequest, hint: RouteHint | None
                    ) -> tuple[ResponseStart, DeploymentResponseGenerator] | Response:
        """Sends the request; returns the response's start and the rest to read. A replica that
        dies before answering costs one retry on another."""
        for attempt in (1, 2):
            responses = cast(DeploymentResponseGenerator, self.replicas.options(stream=True).handle.remote(
                forwarded, route=hint))
            try:
                start = await responses.__anext__()
            except _DEAD:
                logger.warning("an engine replica died before answering (attempt %d)", attempt)
                continue
            except StopAsyncIteration:
                return APIError(500, "the engine replica sent no response").response()
            if not isinstance(start, ResponseStart):
                responses.cancel()
                return APIError(500, "the engine replica sent a malformed response").response()
            return start, responses
        return APIError(503, "no engine replica could take the request; retry").response()

    @staticmethod
    async def _pieces(responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            async for piece in responses:
                if isinstance(piece, bytes):
                    yield piece
        finally:
            responses.cancel()  # a no-op once it has finished; stops the replica's work if not

    async def _relay(self, responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            async for piece in self._pieces(responses):
                yield piece
        except _DEAD:
            logger.warning("an engine replica died during a stream; ending it with an error")
            yield error_event(APIError(503, "the engine replica serving this request stopped")).encode()
            yield b"data: [DONE]\n\n"

    async def _metrics(self) -> bytes:
        reports: dict[str, tuple[bytes, dict[str, str]]] = {}
        if self._board is not None:
            try:
                reports = await asyncio.wait_for(self._board.collect.remote(), 5.0)
            except (TimeoutError, ray.exceptions.RayError):
                logger.warning("the metrics board did not answer")
        return metrics.merge(reports)
