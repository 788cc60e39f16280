"""``kernellab gateway``: the FastAPI app under uvicorn, draining in-flight streams on SIGTERM."""

from __future__ import annotations

import logging

from kernellab.services.config import GatewaySettings

log = logging.getLogger("kernellab.gateway")


def serve(settings: GatewaySettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from kernellab.services.gateway.app import create_app

    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # First signal: refuse new work (503 + /ready false) while uvicorn stops accepting and waits for
            # open streams, up to drain_timeout_s; uvicorn's own handling does the rest.
            gw = getattr(app.state, "gateway", None)
            if gw is not None and not gw.draining:
                log.info("signal %d: draining in-flight streams (up to %.0fs)", sig, settings.drain_timeout_s)
                gw.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=settings.drain_timeout_s or None,
                            loop="auto", http="auto", lifespan="on")
    Server(config).run()


if __name__ == "__main__":
    serve(GatewaySettings())
