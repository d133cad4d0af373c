"""The ZMQ stream: a real SUB on 127.0.0.1 decodes it; replay after a reconnect loses nothing."""

from __future__ import annotations

import time

import pytest

from cache_support import make_cache, prompt, serve
from events_support import apply_payload, index_view, msgspec_types, new_view, plain
from kvtier.config import build_config
from kvtier.errors import ConfigError
from kvtier.events import KVEventFeed
from kvtier.events.publisher import END_SEQ, ZmqEventPublisher
from kvtier.events.types import AllBlocksCleared, BlockRemoved

zmq = pytest.importorskip("zmq")
CTX = zmq.Context.instance()


def server(**fields):
    flags = {f"server.kv_events_{k}": v for k, v in fields.items()}
    return build_config(env={}, flags=flags).server


def subscriber(endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = CTX.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    return sub


def receive(sock: zmq.Socket, until: float = 5.0) -> list[list[bytes]]:
    """Every message that arrives within ``until`` seconds of quiet-free waiting (0.3 s quiet)."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + until
    while time.monotonic() < deadline and sock.poll(300 if out else 1000):
        out.append(sock.recv_multipart())
    return out


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    dealer = CTX.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            out.append(frames[1:])
            if frames[2] == END_SEQ:
                return out
        raise AssertionError("no end marker")
    finally:
        dealer.close()


def wait_published(feed: KVEventFeed) -> int:
    """Wait until every recorded event went out; returns the batches published."""
    deadline = time.monotonic() + 5
    while feed.publisher.stats()["events"] < feed.recorder.queue.put_total:
        assert time.monotonic() < deadline, feed.stats()
        time.sleep(0.01)
    return feed.publisher.stats()["batches"]


def test_a_sub_socket_decodes_the_stream_into_the_index_view():
    with make_cache(device_pages=6, host_pages=0) as cache:
        feed = KVEventFeed.from_config(server(endpoint="tcp://127.0.0.1:*", topic="kv@pod@m"),
                                       cache.ctx.index)
        try:
            sub = subscriber(feed.publisher.endpoint, b"kv@")
            time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
            for seed in range(4):
                serve(cache, prompt(2, seed=seed))
            messages = receive(sub)
            view = new_view()
            seqs = []
            for topic, seq, payload in messages:
                assert topic == b"kv@pod@m"
                seqs.append(int.from_bytes(seq, "big"))
                apply_payload(view, payload)
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))
            vllm = msgspec_types()
            if vllm is not None:
                kinds = {type(e).__name__ for m in messages for e in vllm.decoder.decode(m[2]).events}
                assert {"VBlockStored", "VBlockRemoved"} <= kinds
            sub.close()
        finally:
            feed.close()


def test_replay_after_a_reconnect_returns_every_buffered_batch_then_the_end_marker():
    with make_cache(host_pages=0) as cache:
        feed = KVEventFeed.from_config(server(endpoint="tcp://127.0.0.1:*",
                                              replay_endpoint="tcp://127.0.0.1:*"),
                                       cache.ctx.index)
        try:
            for seed in range(5):  # nobody subscribed: PUB drops all of these
                serve(cache, prompt(1, seed=seed))
                batches = wait_published(feed)
            assert batches >= 5
            frames = replay(feed.publisher.replay_endpoint, 0)
            assert frames[-1] == [b"", END_SEQ, b""]
            seqs = [int.from_bytes(f[1], "big") for f in frames[:-1]]
            assert seqs == list(range(batches))
            view = new_view()
            for _topic, _seq, payload in frames[:-1]:
                apply_payload(view, payload)
            assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))
            assert [int.from_bytes(f[1], "big") for f in replay(
                feed.publisher.replay_endpoint, batches - 2)[:-1]] == [batches - 2, batches - 1]
        finally:
            feed.close()


def test_the_replay_buffer_keeps_only_the_newest_batches():
    events = [[BlockRemoved([i], "GPU")] for i in range(5)]
    pub = ZmqEventPublisher(lambda _limit: events.pop(0) if events else [], "tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_batches=2)
    try:
        deadline = time.monotonic() + 5
        while pub.stats()["batches"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [int.from_bytes(f[1], "big") for f in replay(pub.replay_endpoint, 0)[:-1]] == [3, 4]
    finally:
        pub.close()


def test_an_endpoint_without_a_wildcard_connects_to_a_binding_subscriber():
    sub = CTX.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    sent = [[AllBlocksCleared()]]
    pub = ZmqEventPublisher(lambda _limit: sent.pop(0) if sent and time.sleep(0.3) is None else [],
                            endpoint)
    try:
        assert pub.endpoint == endpoint
        (message,) = receive(sub)
        assert message[1] == (0).to_bytes(8, "big")
        assert apply_payload(new_view(), message[2]) == [{"type": "AllBlocksCleared"}]
    finally:
        pub.close()
        sub.close()


def test_a_busy_endpoint_is_refused_at_start_naming_the_setting():
    taken = CTX.socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ConfigError, match="kv_events_endpoint"):
            ZmqEventPublisher(lambda _limit: [], taken.getsockopt_string(zmq.LAST_ENDPOINT)
                              .replace("127.0.0.1", "*"))
    finally:
        taken.close(linger=0)


def test_a_malformed_replay_request_is_counted_and_the_socket_keeps_serving():
    pub = ZmqEventPublisher(lambda _limit: [], "tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*")
    try:
        dealer = CTX.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", b"short"))
        deadline = time.monotonic() + 5
        while pub.stats()["replay_invalid"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dealer.close()
        assert replay(pub.replay_endpoint, 0) == [[b"", END_SEQ, b""]]
    finally:
        pub.close()


def test_a_subscriber_that_reconnects_catches_up_from_its_last_sequence_number():
    with make_cache(device_pages=6, host_pages=0) as cache:
        feed = KVEventFeed.from_config(server(endpoint="tcp://127.0.0.1:*",
                                              replay_endpoint="tcp://127.0.0.1:*"),
                                       cache.ctx.index)
        try:
            view, last = new_view(), -1
            for _topic, seq, payload in replay(feed.publisher.replay_endpoint, 0)[:-1]:
                apply_payload(view, payload)
                last = int.from_bytes(seq, "big")
            sub = subscriber(feed.publisher.endpoint)
            time.sleep(0.3)
            serve(cache, prompt(2, seed=20))
            for _topic, seq, payload in receive(sub):
                apply_payload(view, payload)
                last = int.from_bytes(seq, "big")
            sub.close()  # gone while the cache keeps moving (evictions included)
            for seed in range(21, 25):
                serve(cache, prompt(2, seed=seed))
            wait_published(feed)
            caught_up = replay(feed.publisher.replay_endpoint, last + 1)[:-1]
            assert caught_up and int.from_bytes(caught_up[0][1], "big") == last + 1
            for _topic, _seq, payload in caught_up:
                apply_payload(view, payload)
            assert plain(view) == plain(index_view(cache.ctx.index, feed.recorder.namer))
        finally:
            feed.close()
