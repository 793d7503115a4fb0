"""The decode service's HTTP app: `create_app(config)` builds the FastAPI app whose lifespan loads the model,
starts the engine thread, registers the Mooncake arena and watches the prefill peers."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from .completions import chat_completions, completions
from .config import DecodeConfig
from .generation import RequestError, ServiceContext
from .prefill_client import LayoutMismatch, PrefillPeers
from .runtime import build_context
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def error_body(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(cfg: DecodeConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx = await asyncio.to_thread(build_context, cfg, asyncio.get_running_loop())
        ctx.peers = PrefillPeers(cfg.peers, ctx.layout_hash)
        app.state.ctx = ctx
        watcher = asyncio.create_task(_watch_peers(app, ctx))
        print(f"decode service ready on http://{cfg.host}:{cfg.port} (model {ctx.model_name})", flush=True)
        try:
            yield
        finally:
            watcher.cancel()
            ctx.worker.shutdown()
            await ctx.peers.close()

    app = FastAPI(title="dspark-pd decode", lifespan=lifespan)
    app.state.fatal = None

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return JSONResponse(error_body(e.status, e.message, e.kind, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        if err.get("type") == "json_invalid":
            param = None  # loc holds a character offset
            message = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):  # unknown path (404), wrong method (405), ...
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"),
                            status_code=500)

    async def authorize(request: Request) -> None:
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    def ctx_of(request: Request) -> ServiceContext:
        return request.app.state.ctx

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def _chat(request: Request, body: ChatCompletionRequest):
        return await chat_completions(ctx_of(request), request, body)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def _completions(request: Request, body: CompletionRequest):
        return await completions(ctx_of(request), request, body)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def _models(request: Request):
        ctx = ctx_of(request)
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "created": int(ctx.started),
                                            "owned_by": "dspark-pd", "max_model_len": ctx.max_model_len}]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def _model(request: Request, model_id: str):
        listing = await _models(request)
        found = [m for m in listing["data"] if m["id"] == model_id]
        if not found:
            raise RequestError(404, f"the model {model_id!r} does not exist", param="model")
        return found[0]

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.get("/ready")
    async def _ready(request: Request):
        ctx = ctx_of(request)
        peers = {p.address: p.ready for p in ctx.peers.peers}
        return JSONResponse({"ready": ctx.peers.ready, "prefill": peers}, status_code=200 if ctx.peers.ready else 503)

    @app.get("/metrics")
    async def _metrics(request: Request):
        ctx = ctx_of(request)
        m = ctx.metrics
        m.running.set(ctx.worker.running)
        m.waiting.set(ctx.admission.waiting)
        m.free_slots.set(ctx.worker.engine.runner.alloc.free_slot_count)
        m.free_arena.set(ctx.receiver.arena.free_bytes)
        m.quarantined.set(ctx.receiver.arena.quarantined)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _watch_peers(app: FastAPI, ctx: ServiceContext) -> None:
    while True:
        try:
            await ctx.peers.check()
        except LayoutMismatch as e:
            log.critical("%s", e)
            app.state.fatal = str(e)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(1.0)
