"""Publisher endpoints: data-parallel port offsets and the ``allowed_publishers`` check.

Shared by the ZMQ source, the TensorRT-LLM poller and config validation, so "which
endpoint does DP rank r publish on" and "may this host publish to us" have one answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Iterable

__all__ = [
    "SCHEMES",
    "PublisherAllowlist",
    "PublisherNotAllowedError",
    "expand_dp_endpoints",
    "is_ipv6_endpoint",
    "offset_endpoint",
    "tcp_host_port",
]

SCHEMES = ("tcp://", "ipc://", "inproc://")
_SCHEMES = SCHEMES
logger = logging.getLogger("continuum.listener.endpoints")
_HOSTNAME = re.compile(r"^(?=.{1,253}\Z)[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\Z")


class PublisherNotAllowedError(ValueError):
    """A publisher endpoint's host is not in ``allowed_publishers``. Not retried."""

    def __init__(self, host: str, addresses: Iterable[str], allowed: Iterable[str]) -> None:
        self.host = host
        self.addresses = tuple(addresses)
        self.allowed = tuple(allowed)
        resolved = (
            f" (resolves to {', '.join(self.addresses)})"
            if self.addresses and self.addresses != (host,)
            else ""
        )
        super().__init__(
            f"publisher host {host!r}{resolved} is not in allowed_publishers "
            f"{list(self.allowed)}; add it (IP, CIDR or hostname) or fix the endpoint"
        )


def _normalize_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip().strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class PublisherAllowlist:
    """``allowed_publishers``: IP addresses, CIDR networks and hostnames.

    Hostnames are resolved by :meth:`refresh` (call it before each connection lifetime);
    a name that does not resolve allows nothing. IPv4-mapped IPv6 peers match their IPv4
    form.

    Raises:
        ValueError: an entry is neither an IP, a CIDR nor a hostname.
    """

    def __init__(self, entries: Iterable[str]) -> None:
        self.entries: tuple[str, ...] = tuple(str(e).strip() for e in entries)
        nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        names: list[str] = []
        for entry in self.entries:
            try:
                nets.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not _HOSTNAME.match(entry):
                raise ValueError(
                    f"allowed_publishers entry {entry!r} is not an IP address, CIDR or hostname"
                )
            names.append(entry.lower().rstrip("."))
        self._networks = tuple(nets)
        self._hostnames = frozenset(names)
        self._resolved: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.entries)

    async def refresh(self) -> None:
        """Resolve the hostname entries (never blocks the loop). Unresolvable names are logged."""
        loop = asyncio.get_running_loop()
        found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
        for name in sorted(self._hostnames):
            try:
                infos = await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("allowed_publishers: cannot resolve %r: %s", name, exc)
                continue
            found.update(ip for info in infos if (ip := _normalize_ip(str(info[4][0]))))
        self._resolved = frozenset(found)

    def allows_address(self, address: str) -> bool:
        """Whether a peer IP address (as ZAP or a socket reports it) is allowed."""
        ip = _normalize_ip(address)
        if ip is None:
            return False
        return ip in self._resolved or any(ip in net for net in self._networks)

    async def check_host(self, host: str) -> None:
        """Allow ``host`` (IP or hostname) only if it, and every address it resolves to, is listed.

        Raises:
            PublisherNotAllowedError: it is not.
            OSError: the name does not resolve (``socket.gaierror``); retryable.
        """
        if host.lower().rstrip(".") in self._hostnames:
            return
        ip = _normalize_ip(host)
        if ip is not None:
            addresses = [str(ip)]
        else:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            addresses = sorted({str(info[4][0]).split("%", 1)[0] for info in infos})
        if not addresses or not all(self.allows_address(a) for a in addresses):
            raise PublisherNotAllowedError(host, addresses, self.entries)


# --------------------------------------------------------------------------------------------
# Endpoints


def tcp_host_port(endpoint: str) -> tuple[str, str]:
    """``tcp://[src;]host:port`` -> (host without brackets, port text)."""
    rest = endpoint[len("tcp://") :].rsplit(";", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"tcp endpoint needs host:port, got {endpoint!r}")
    return host.strip("[]"), port


def is_ipv6_endpoint(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and ":" in tcp_host_port(endpoint)[0]


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint a data-parallel rank publishes on (the engines' own rule, §1).

    ``tcp://h:5557`` becomes ``tcp://h:5557+rank``; ``inproc://x`` becomes
    ``inproc://x_dp<rank>``; rank 0 is unchanged. The engines have no rule for ``ipc://``
    with data parallelism (they reject it), so neither do we.

    Raises:
        ValueError: negative rank, no numeric port, a port above 65535, or an unknown scheme.
    """
    if dp_rank < 0:
        raise ValueError(f"dp rank must be >= 0, got {dp_rank}")
    if not endpoint.startswith(_SCHEMES):
        raise ValueError(f"endpoint must start with tcp://, ipc:// or inproc://: {endpoint!r}")
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("ipc://"):
        raise ValueError(f"ipc:// endpoints cannot be offset per DP rank: {endpoint!r}")
    _, port = tcp_host_port(endpoint)
    if not port.isdigit():
        raise ValueError(f"cannot offset a non-numeric port for dp rank {dp_rank}: {endpoint!r}")
    new_port = int(port) + dp_rank
    if new_port > 65535:
        raise ValueError(f"port {new_port} for dp rank {dp_rank} exceeds 65535 ({endpoint!r})")
    return f"{endpoint[: endpoint.rfind(':')]}:{new_port}"


def expand_dp_endpoints(
    endpoint: str, dp_ranks: int | Iterable[int], replay_endpoint: str | None = None
) -> list[tuple[int, str, str | None]]:
    """One ``(rank, endpoint, replay_endpoint)`` per data-parallel rank.

    Args:
        endpoint: rank 0's endpoint.
        dp_ranks: the number of ranks (``0..n-1``) or the ranks themselves.
        replay_endpoint: rank 0's replay endpoint, offset the same way; ``None`` stays ``None``.
    """
    ranks = range(dp_ranks) if isinstance(dp_ranks, int) else list(dp_ranks)
    return [
        (
            rank,
            offset_endpoint(endpoint, rank),
            offset_endpoint(replay_endpoint, rank) if replay_endpoint else None,
        )
        for rank in ranks
    ]
