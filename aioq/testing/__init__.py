"""Testing code that uses aioq: helpers, and the pytest plugin (``pip install 'aioq-pg[testing]'``).

``job_context`` runs a task function directly with a job context; ``deferred`` lists what a task
has waiting; ``drain`` runs every ready job. The plugin (:mod:`aioq.testing.plugin`) is
registered through the ``pytest11`` entry point; its fixtures are ``aioq_dsn``,
``aioq_registry``, ``aioq_conn``, ``aioq_worker`` and ``aioq_drain``.
"""

from aioq.testing.context import job_context
from aioq.testing.helpers import Drain, DrainError, Ran, Waiting, deferred, drain

__all__ = ("Drain", "DrainError", "Ran", "Waiting", "deferred", "drain", "job_context")
