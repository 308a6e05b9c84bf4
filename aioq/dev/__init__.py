"""Development helpers outside the core: the embedded throwaway PostgreSQL for the demo and tests."""

from aioq.dev.server import EmbeddedPostgres, find_binaries

__all__ = ("EmbeddedPostgres", "find_binaries")
