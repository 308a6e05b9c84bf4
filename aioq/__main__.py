"""Run the ``aioq`` command line: ``python -m aioq``."""

from aioq import cli

raise SystemExit(cli.main())
