"""Which ``Host`` names the dashboard answers: the guard against DNS rebinding (no I/O).

A page on ``evil.example`` whose name the attacker re-points at 127.0.0.1 makes the browser
send its requests, cookies of ``evil.example`` and all, to a dashboard on the victim's
loopback: same origin to the browser, so the page reads the answers (a CSRF token included)
and posts actions. What still tells it apart is the ``Host`` header, which carries the name the
page used. So, as Django's ``ALLOWED_HOSTS`` and Jupyter do, a dashboard answers only names it
knows are its own: the address the server accepted the connection on (the ASGI ``server``),
``localhost``, ``127.0.0.1`` and ``[::1]`` when that address is a loopback one, and the names it
is given (``allowed_hosts``: an exact name or IP, ``.example.com`` for that domain and its
subdomains, ``*`` for any). A request without a ``Host`` header names nothing and passes.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aioq.errors import ConfigError

__all__ = ("AllowedHosts", "host_name")

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
# A Host header: a DNS name or IPv4 address, or an IPv6 address in brackets; then a port.
_HOST = re.compile(r"(?P<name>[a-z0-9._-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?")
_NAME = re.compile(r"\.?[a-z0-9._-]*[a-z0-9]\.?")  # an allowed name (IPv6: checked apart)
SHOWN = 80  # characters of a refused Host the refusal repeats


def host_name(value: str) -> str | None:
    """The name a ``Host`` header carries, without its port and normalised (lower case, no
    trailing dot, an IP address in its canonical form); None if it is not a host name."""
    found = _HOST.fullmatch(value.strip().lower())
    return None if found is None else _normal(found["name"])


def _normal(name: str) -> str:
    """A host name or IP address as compared: IPv6 in brackets, compressed; IPv4-mapped IPv6
    as the IPv4 address it maps."""
    name = name.rstrip(".")
    try:
        ip = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return name
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) if ip.version == 4 else f"[{ip.compressed}]"


def _server_names(server: object) -> set[str]:
    """The names of the address the server accepted the request on (the ASGI ``server``)."""
    if not isinstance(server, Sequence) or not server or not isinstance(server[0], str):
        return set()  # a Unix socket, or a server that does not say
    own = _normal(server[0].lower())
    try:
        loopback = ipaddress.ip_address(own.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        loopback = False
    return {own, *LOOPBACK_NAMES} if loopback else {own}


def _ipv6(text: str) -> bool:
    """Whether ``text`` is an IPv6 address, in brackets or not."""
    try:
        ipaddress.IPv6Address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class AllowedHosts:
    """The names a dashboard answers beyond its server's own address (see the module)."""

    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()  # ".example.com": that domain and its subdomains
    anything: bool = False  # "*"

    @classmethod
    def of(cls, given: Iterable[str]) -> AllowedHosts:
        """Parse ``allowed_hosts``; a ConfigError names what is not a host name."""
        if isinstance(given, str | bytes):
            raise ConfigError("allowed_hosts", f"must be a list of host names, got {given!r}")
        names: set[str] = set()
        domains: list[str] = []
        anything = False
        for entry in given:
            if not isinstance(entry, str):
                raise ConfigError("allowed_hosts", f"must be host names (str), got {entry!r}")
            text = entry.strip().lower()
            if text == "*":
                anything = True
            elif not (_NAME.fullmatch(text) or _ipv6(text)):
                raise ConfigError(
                    "allowed_hosts",
                    f"{entry!r} is not a host name (a name or IP without scheme, port or path;"
                    " '.example.com' for a domain and its subdomains, '*' for any)",
                )
            elif text.startswith("."):
                domains.append(text.rstrip("."))
            else:
                names.add(_normal(text))
        return cls(frozenset(names), tuple(domains), anything)

    def refusal(self, headers: Iterable[tuple[bytes, bytes]], server: object) -> str | None:
        """Why a request is refused (a 400's text), or None when its Host is allowed."""
        if self.anything:
            return None
        given = [value.decode("latin-1") for key, value in headers if key == b"host"]
        allowed = self.names | _server_names(server)
        for value in given:
            name = host_name(value)
            if name is not None and (
                name in allowed or any(name == d[1:] or name.endswith(d) for d in self.domains)
            ):
                continue
            shown = value if len(value) <= SHOWN else value[:SHOWN] + "..."
            return (
                f"refused: {shown!r} is not a host name this dashboard answers to (a guard"
                " against DNS rebinding). To serve it under that name, allow it: aioq web"
                " --allowed-host NAME, or aioq.web.app(allowed_hosts=[...])."
            )
        return None
