"""``aioq web``: the dashboard on its own server (needs the ``aioq-pg[web]`` extra).

uvicorn, Starlette and Jinja2 are imported here only, when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os

from aioq.cli.common import EXIT_OK, UsageError, dsn_from, schema_from
from aioq.errors import ConfigError

log = logging.getLogger("aioq.cli")

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")  # --host values that bind every address

SECRET_VARIABLE = "AIOQ_WEB_SECRET"
"""The secret that signs the dashboard's CSRF tokens: the same in every ``aioq web`` serving
one address (behind a load balancer); unset, each process makes a random one."""


def cmd_web(args: argparse.Namespace) -> int:
    """Serve the dashboard until Ctrl-C; bind 127.0.0.1 unless told otherwise."""
    dsn = dsn_from(args)
    try:
        import uvicorn

        import aioq.web
        from aioq.web.hosts import AllowedHosts
    except ImportError as exc:
        raise UsageError(
            f"aioq web needs the web extra ({exc.name} is missing): pip install 'aioq-pg[web]'"
        ) from None
    secret = os.environ.get(SECRET_VARIABLE) or None
    # The dashboard answers its server's address (and localhost on a loopback one); the name
    # --host gives is its own too, unless it binds every address.
    named = [] if args.host in WILDCARD_HOSTS else [args.host]
    try:
        AllowedHosts.of(args.allowed_host or ())
    except ConfigError as exc:
        raise UsageError(f"argument --allowed-host: {exc.problem}") from None
    try:
        dashboard = aioq.web.app(
            dsn=dsn,
            schema=schema_from(args),
            actions=args.actions,
            refresh=args.refresh,
            secret=secret,
            allowed_hosts=[*named, *(args.allowed_host or ())],
        )
    except ConfigError as exc:
        if exc.field == "secret":
            raise UsageError(f"{SECRET_VARIABLE}: {exc.problem}") from None
        if exc.field == "allowed_hosts":
            raise UsageError(f"argument --host: {exc.problem}") from None
        raise
    log.info(
        "aioq dashboard on http://%s:%d/ (%s)",
        args.host,
        args.port,
        "actions enabled" if args.actions else "read-only",
    )
    if args.actions and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "actions are enabled on %s with no authentication: put a proxy in front", args.host
        )
    uvicorn.run(dashboard, host=args.host, port=args.port, log_level="warning")
    return EXIT_OK
