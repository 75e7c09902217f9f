"""The fleet's front door: the HTTP server of the `inflight serve --replicas` process, which
forwards each request to an engine replica through a Ray Serve deployment handle, whose router
picks the replica.

It runs in the driver, under uvicorn, rather than as a deployment behind Ray Serve's HTTP proxy:
each streamed chunk then crosses Ray once (replica to ingress) instead of twice, and no proxy
process competes with the engines for cores. The ingress reads just enough of a request to route
it: it tokenizes the prompt (or renders the chat), exactly as the replica will, and passes the
prompt's block keys along as the call's `route` (`RouteHint`). It answers `/metrics` (every
replica's series, labelled) itself; everything else, errors included, is the replica's answer,
unchanged. If a replica dies before its answer has begun, the request goes to another once; once
a stream has begun, it ends with an error event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import ray
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from inflight.engine.block_manager import block_hashes
from inflight.errors import InflightError
from inflight.fleet import metrics
from inflight.fleet.asgi import ForwardedRequest, ResponseStart, forwardable
from inflight.fleet.relay import END, Failed, Inbox, Relayed
from inflight.fleet.routing import RouteHint
from inflight.model.loader import resolve_model
from inflight.model.tokenizer import Tokenizer
from inflight.server.app import read_raw_body
from inflight.server.config import ServerConfig
from inflight.server.errors import APIError, error_event
from inflight.server.protocol import ChatCompletionRequest, CompletionRequest
from inflight.server.serving import ClosingStreamingResponse, wait_disconnect

logger = logging.getLogger("uvicorn.error")  # in the driver, beside uvicorn's own messages
_T = TypeVar("_T")

_DEAD = (RayActorError, ActorUnavailableError)  # the replica's process is gone or unreachable


def prompt_tokens(path: str, body: bytes, tokenizer: Tokenizer, chat_template: str | None) -> list[int] | None:
    """The token ids the replica will compute for this request (the first prompt of a batch),
    or None where the body is not a generation request (the replica will say what is wrong)."""
    try:
        if path == "/v1/completions":
            completion = CompletionRequest.model_validate_json(body)
            prompt = completion.prompts[0]
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            return completion.truncated(ids, None)  # the replica's context is not known here
        if path == "/v1/chat/completions":
            chat = ChatCompletionRequest.model_validate_json(body)
            messages = [m.to_template() for m in chat.messages]
            ids = tokenizer.apply_chat_template(messages, chat.add_generation_prompt, chat.template_tools(),
                                                chat_template, chat.continue_final_message, chat.chat_template_kwargs)
            return chat.truncated(ids, None)
    except (ValidationError, InflightError, ValueError, IndexError):
        return None
    return None



class ReplicaGone(Exception):
    """The replica serving a request stopped before its answer ended."""


_Opened = tuple[ResponseStart, AsyncIterator[bytes], Callable[[], None]]  # start, body, stop


class FleetIngress:
    """`relay`: answers come a step's pieces at a time (`inflight.fleet.relay`); that needs the
    inflight router, which can pin the abort of a relayed request to its replica."""

    def __init__(self, replicas: DeploymentHandle, model: str | None, block_size: int, server: ServerConfig,
                 board: Any = None, relay: bool = True) -> None:
        self.replicas = replicas
        self.relay = relay
        self.ingress_id = uuid.uuid4().hex
        self.inbox = Inbox()
        self._tasks: set[asyncio.Future[Any]] = set()
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

    async def drain(self, timeout_s: float, give_up: Callable[[], bool] = lambda: False) -> int:
        """Refuses new requests (503), waits up to `timeout_s` (or until `give_up()`) for the
        forwarded ones to end; returns how many had not. The server's shutdown calls it."""
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < deadline and not give_up():
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
        # A client may leave before its answer begins (a whole completion's starts only once it is
        # done) or while a whole body is gathered: the request then ends on its replica at once.
        left = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            opened = await _unless_gone(self._open(forwarded, hint), left)
        except BaseException:
            left.cancel()
            self.num_active -= 1
            raise
        if opened is None or isinstance(opened, Response):
            left.cancel()
            self.num_active -= 1
            return opened if opened is not None else Response(status_code=499)  # 499: nobody reads it
        start, pieces, stop = opened
        headers = dict(start.headers)
        if start.media_type != "text/event-stream":
            try:
                content = await _unless_gone(_joined(pieces), left)
            except ReplicaGone:
                return APIError(503, "the engine replica serving this request stopped; retry").response()
            finally:
                left.cancel()
                stop()
                self.num_active -= 1
            return Response(content, status_code=start.status, headers=headers) if content is not None \
                else Response(status_code=499)
        if left.done():  # gone as the stream began
            stop()
            self.num_active -= 1
            return Response(status_code=499)
        left.cancel()  # from here the streaming response watches for the client itself

        def finished() -> None:  # however the stream ended: the client may have left first
            stop()
            self.num_active -= 1

        return ClosingStreamingResponse(self._stream(pieces), on_close=finished, status_code=start.status,
                                        headers=headers)

    @staticmethod
    async def _stream(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for piece in pieces:
                yield piece
        except ReplicaGone:
            logger.warning("an engine replica died during a stream; ending it with an error")
            yield error_event(APIError(503, "the engine replica serving this request stopped")).encode()
            yield b"data: [DONE]\n\n"

    async def _open(self, forwarded: ForwardedRequest, hint: RouteHint | None) -> _Opened | Response:
        """Sends the request; returns the response's start, its body (whose iteration raises
        ReplicaGone if the replica dies) and `stop`, to call once the body is done with: it ends
        the request on its replica if it is still running (the client left). A replica that
        dies before answering costs one retry."""
        open_once = self._open_relayed if self.relay else self._open_direct
        for attempt in (1, 2):
            try:
                return await open_once(forwarded, hint)
            except ReplicaGone:
                logger.warning("an engine replica died before answering (attempt %d)", attempt)
        return APIError(503, "no engine replica could take the request; retry").response()

    # --- one stream per request (Ray Serve's own router) ---------------------------------------

    async def _open_direct(self, forwarded: ForwardedRequest, hint: RouteHint | None) -> _Opened | Response:
        responses = cast(DeploymentResponseGenerator, self.replicas.options(stream=True).handle.remote(
            forwarded, route=hint))
        try:
            start = await responses.__anext__()
        except _DEAD as exc:
            raise ReplicaGone(str(exc)) from None
        except StopAsyncIteration:
            return APIError(500, "the engine replica sent no response").response()
        except BaseException:  # cancelled: the client left before the answer began
            responses.cancel()
            raise
        if not isinstance(start, ResponseStart):
            responses.cancel()
            return APIError(500, "the engine replica sent a malformed response").response()
        return start, self._direct_pieces(responses), responses.cancel  # a no-op once it has finished

    @staticmethod
    async def _direct_pieces(responses: DeploymentResponseGenerator) -> AsyncIterator[bytes]:
        try:
            async for piece in responses:
                if isinstance(piece, bytes):
                    yield piece
        except _DEAD as exc:
            raise ReplicaGone(str(exc)) from None

    # --- relayed: a step's pieces in one batch per replica (inflight.fleet.relay) --------------

    async def _open_relayed(self, forwarded: ForwardedRequest, hint: RouteHint | None) -> _Opened | Response:
        key = uuid.uuid4().hex
        inbox = self.inbox.expect(key)
        call = cast(DeploymentResponseGenerator, self.replicas.options(stream=True).handle.remote(
            forwarded, route=hint, reply_to=self.ingress_id, key=key))
        relayed: Relayed | None = None
        try:
            try:
                relayed = await call.__anext__()
            except _DEAD as exc:
                raise ReplicaGone(str(exc)) from None
            except StopAsyncIteration:
                relayed = None
            if not isinstance(relayed, Relayed):
                call.cancel()
                self.inbox.forget(key)
                return APIError(500, "the engine replica sent a malformed response").response()
            self.inbox.placed(key, relayed.replica_id)
            self._spawn(self._read_channel(call, relayed.replica_id) if relayed.channel else self._watch(call, key))
            first = await inbox.get()
            if isinstance(first, Failed):
                raise ReplicaGone(first.reason)
            if not isinstance(first, ResponseStart):
                self.inbox.forget(key)
                return APIError(500, "the engine replica sent no response").response()
        except ReplicaGone:  # nothing to stop there
            self.inbox.forget(key)
            raise
        except BaseException:
            self.inbox.forget(key)
            if relayed is not None:
                self._abandon(key, call, relayed)
            raise
        ended = False

        async def pieces() -> AsyncIterator[bytes]:
            nonlocal ended
            while (item := await inbox.get()) != END:
                if isinstance(item, Failed):
                    ended = True
                    raise ReplicaGone(item.reason)
                if isinstance(item, bytes):
                    yield item
            ended = True

        def stop() -> None:
            nonlocal ended
            self.inbox.forget(key)
            if not ended:
                ended = True
                self._abandon(key, call, relayed)

        return first, pieces(), stop

    def _abandon(self, key: str, call: DeploymentResponseGenerator, relayed: Relayed) -> None:
        """Stops a relayed request on its replica. The channel's own call carries others' pieces
        too, so that request is aborted by a call pinned to its replica instead."""
        if relayed.channel:
            self._spawn(self.replicas.abort.remote(self.ingress_id, key, to_replica=relayed.replica_id))
        else:
            call.cancel()

    async def _read_channel(self, call: DeploymentResponseGenerator, replica_id: str) -> None:
        try:
            async for batch in call:
                self.inbox.deliver(batch)
        except _DEAD:
            logger.warning("an engine replica died; ending its requests with an error")
            self.inbox.fail_replica(replica_id, "the engine replica stopped")
        except Exception:
            logger.exception("a replica's channel broke; ending its requests with an error")
            self.inbox.fail_replica(replica_id, "the engine replica's channel broke")

    async def _watch(self, call: DeploymentResponseGenerator, key: str) -> None:
        """Waits out a relayed request's own call, which carries nothing: it only fails if the
        replica dies (its pieces come through the channel)."""
        try:
            async for _ in call:
                pass
        except _DEAD:
            self.inbox.fail(key, "the engine replica stopped")
        except Exception:  # cancelled, its client having left; or the request failed, and said so
            pass

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._spawned_done)

    def _spawned_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # an abort whose replica had gone
            logger.debug("fleet ingress task failed: %r", task.exception())

    async def _metrics(self) -> bytes:
        reports: dict[str, tuple[bytes, dict[str, str]]] = {}
        if self._board is not None:
            try:
                reports = await asyncio.wait_for(self._board.collect.remote(), 5.0)
            except (TimeoutError, ray.exceptions.RayError):
                logger.warning("the metrics board did not answer")
        return metrics.merge(reports)


def ingress_app(ingress: FleetIngress) -> ASGIApp:
    """The ingress as an ASGI app, for uvicorn (run with `lifespan="off"`: the fleet's life is
    the launcher's)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            response = await ingress(Request(scope, receive))
        except Exception:
            logger.exception("the ingress failed on %s %s", scope.get("method"), scope.get("path"))
            response = APIError(500, "the fleet's ingress failed on this request").response()
        await response(scope, receive, send)

    return app


async def _joined(pieces: AsyncIterator[bytes]) -> bytes:
    return b"".join([piece async for piece in pieces])


async def _unless_gone(work: Awaitable[_T], left: asyncio.Future[None]) -> _T | None:
    """`work`'s result; or, if the client leaves first (`left` is done), None, `work` cancelled
    and its clean-up run (a request it opened on a replica is stopped there)."""
    task = asyncio.ensure_future(work)
    either: set[asyncio.Future[Any]] = {task, left}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None
