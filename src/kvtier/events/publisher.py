"""The ZMQ side of KV events: a PUB socket, a ROUTER replay socket and their thread.

Owns ``ZmqEventPublisher``, vLLM 0.32's publishing protocol:

- every batch goes out on PUB as three frames ``(topic, seq, payload)``: ``seq`` is a
  per-publisher counter from 0 as 8 bytes big-endian, ``payload`` the msgpack batch;
- with a replay endpoint, a ROUTER socket answers ``(b"", start_seq)`` from a DEALER (or a bare
  ``start_seq`` from a REQ) with every buffered batch ``seq >= start_seq`` as
  ``(b"", topic, seq, payload)``, then the end marker ``(b"", b"", -1 as 8 signed bytes, b"")``;
  the buffer keeps the last ``buffer_batches`` batches;
- an endpoint with ``*`` or ``::``, or an ipc/inproc one, is bound; any other is connected to (a
  subscriber such as llm-d's indexer binds it). The replay endpoint is always bound.

Sockets are opened and bound by the constructor (a bad or busy endpoint fails at start, naming
the setting) and then used only by the publisher thread, which takes pending events from
``source`` (``EventRecorder.take``), batches and sends them. The engine thread never touches a
socket. Closing sends what is pending, then stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtier.errors import ConfigError
from kvtier.events.encode import encode_batch
from kvtier.events.types import KVEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: PUB high-water mark in messages (batches), vLLM's default: a subscriber that falls this far
#: behind loses batches in ZMQ (and can get them back from the replay buffer).
PUB_HWM = 100_000


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes ``source(limit)``'s events every ``interval_s`` (see the module docstring)."""

    def __init__(self, source: Callable[[int], list[KVEvent]], endpoint: str, *, topic: str = "",
                 replay_endpoint: str = "", buffer_batches: int = 10_000,
                 max_batch_events: int = 1024, interval_s: float = 0.005,
                 data_parallel_rank: int = 0) -> None:
        if buffer_batches < 1:
            raise ConfigError("server.kv_events_buffer_batches", buffer_batches, "an integer >= 1")
        zmq = _zmq()
        self._zmq = zmq
        self.source = source
        self.topic = topic.encode("utf-8")
        self.max_batch_events = max_batch_events
        self.interval_s = interval_s
        self.rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.counts = {"batches": 0, "events": 0, "replay_requests": 0, "replay_invalid": 0,
                       "errors": 0}
        self._seq = 0
        self._stop = threading.Event()
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(PUB_HWM)
        self.pub.setsockopt(zmq.LINGER, 500)
        self.endpoint = self._open(self.pub, endpoint, "server.kv_events_endpoint", binds(endpoint))
        self.replay = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._open(self.replay, replay_endpoint,
                                              "server.kv_events_replay_endpoint", True)
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def _open(self, sock: Any, endpoint: str, field: str, bind: bool) -> str:
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
            return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)
        except self._zmq.ZMQError as exc:
            sock.close(linger=0)
            if sock is not self.pub:
                self.pub.close(linger=0)
            raise ConfigError(field, endpoint, f"a ZMQ endpoint this process can "
                              f"{'bind' if bind else 'connect to'} ({exc})") from None

    # ---- publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step(wait=True)
            while self._step(wait=False):  # closing: send what is pending
                pass
        finally:
            self.pub.close()
            if self.replay is not None:
                self.replay.close()

    def _step(self, wait: bool) -> bool:
        """Serve replay requests, publish one batch; True if a batch went out."""
        try:
            while self.replay is not None and self.replay.poll(0):
                self._serve_replay()
            events = self.source(self.max_batch_events)
            if events:
                self._publish(events)
                return True
            if wait:
                self._idle()
        except Exception:  # a bad batch must not stop the stream
            self.counts["errors"] += 1
            log.exception("KV event publishing failed")
            time.sleep(0.1)
        return False

    def _idle(self) -> None:
        if self.replay is not None:
            self.replay.poll(int(self.interval_s * 1000) or 1)
        else:
            self._stop.wait(self.interval_s)

    def _publish(self, events: list[KVEvent]) -> None:
        seq = self._seq
        self._seq += 1
        payload = encode_batch(time.time(), events, self.rank)
        self.buffer.append((seq, payload))
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.counts["batches"] += 1
        self.counts["events"] += len(events)

    def _serve_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.counts["replay_invalid"] += 1
            log.warning("ignored a KV event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.counts["replay_requests"] += 1
        for seq, payload in list(self.buffer):
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                            payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # ---- any thread ---------------------------------------------------------------------------
    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "buffered_batches": len(self.buffer), "next_seq": self._seq,
                "alive": self._thread.is_alive()}


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise ConfigError("server.kv_events_endpoint", "set",
                          "only with pyzmq installed (pip install 'kvtier[events]')") from None
    return zmq
