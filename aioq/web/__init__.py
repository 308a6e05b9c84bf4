"""The aioq dashboard (the ``aioq-pg[web]`` extra): queues, workers, throughput, jobs, actions.

Mount it in any ASGI app::

    app.mount("/aioq", aioq.web.app(dsn=DSN))                 # read-only
    app.mount("/aioq", aioq.web.app(pool=pool, actions=True,  # replay, cancel, delete
                                    authorize=lambda request: is_admin(request)))

or run it alone: ``aioq web --dsn ... --host 127.0.0.1 --port 8080``. Starlette and Jinja2 are
imported here, never by the core.
"""

from __future__ import annotations

from aioq.web.app import DashboardConfig, app

__all__ = ("DashboardConfig", "app")
