"""Testing code that uses aioq: helpers, and the pytest plugin (``pip install 'aioq-pg[testing]'``).

The plugin (:mod:`aioq.testing.plugin`) is registered through the ``pytest11`` entry point; its
fixtures are ``aioq_dsn``, ``aioq_registry``, ``aioq_conn``, ``aioq_worker`` and ``aioq_drain``.
"""

from aioq.testing.helpers import Drain, DrainError, Ran, Waiting, deferred, drain

__all__ = ("Drain", "DrainError", "Ran", "Waiting", "deferred", "drain")
