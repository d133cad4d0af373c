"""``ConnectionTable`` without a server: per-client caps, eviction of stalled connections."""

from __future__ import annotations

import asyncio

from kvtier.serve.connections import BUSY, Connection, ConnectionTable
from kvtier.serve.limits import LimitCounters


class FakeTransport:
    def __init__(self, host: str) -> None:
        self.host, self.written, self.closing = host, b"", False

    def get_extra_info(self, name: str) -> object:
        return (self.host, 1234) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


def _open(table: ConnectionTable, host: str = "10.0.0.1") -> tuple[Connection, bool]:
    conn = Connection(table)
    conn.attach(FakeTransport(host))
    return conn, table.open(conn)


def test_one_more_connection_evicts_the_oldest_stalled_one_of_that_client_only() -> None:
    async def scenario() -> None:
        counters = LimitCounters()
        table = ConnectionTable(max_per_client=1, header_timeout_s=0, counters=counters)
        first, _ = _open(table)
        other, _ = _open(table, "10.0.0.2")
        second, admitted = _open(table)
        assert admitted and first.transport.closing and not other.transport.closing
        assert table.count("10.0.0.1") == 1 and counters.connections_open == 2
        second.request_started(has_body=False)
        assert second.state == BUSY
        third, admitted = _open(table)
        assert not admitted and b"429 Too Many Requests" in third.transport.written
        assert counters.rejected_total == {"connection_evicted": 1, "too_many_connections": 1}
        second.lost()
        other.lost()
        assert counters.connections_open == 0 and table.count("10.0.0.1") == 0

    asyncio.run(scenario())
