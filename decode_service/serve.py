"""`dspark-pd serve-decode`: the decode service under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .config import DecodeConfig


def serve(cfg: DecodeConfig, log_level: str = "INFO") -> int:
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level.lower(),
                                           lifespan="on", timeout_graceful_shutdown=5))
    server.run()
    if app.state.fatal:
        logging.getLogger(__name__).error("stopped: %s", app.state.fatal)
        return 3
    return 0 if server.started else 1
