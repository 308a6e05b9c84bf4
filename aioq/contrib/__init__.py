"""Integrations that import a third-party library, each loaded only when used."""
