"""kvtier's vLLM connector on the direct path (``"direct": true``), worker half, on the CPU:
prompts saved from vLLM-shaped KV tensors straight into host pages load back byte for byte into
other blocks, with kvtier's row kernel (under TRITON_INTERPRET=1) and with the torch gathers;
the host pages are kvtier's canonical pages (the staged path and the stores read the same
bytes); no staging page is used. No vLLM needed (the GPU version is in
``test_vllm_copy_gpu``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.layout import block_layout
from kvtier.integrations.vllm.options import parse_connector_config
from kvtier.integrations.vllm.specs import LoadSpec, SaveSpec
from vllm_copy_support import (
    BACKENDS,
    BLOCK,
    DIM,
    HEADS,
    LAYERS,
    NEW,
    NUM_BLOCKS,
    OLD,
    Step,
    as_words,
    check_moved,
    direct_round_trip,
    interpreted,
    make_runtime,
    slots,
)


def _prompt(n: int) -> list[int]:
    return [(37 * i + 11) % 1000 + 5 for i in range(n)]


@pytest.fixture(params=["page_first", "layer_first"])
def runtime(request):
    rt = make_runtime(LAYERS, HEADS, DIM, torch.bfloat16, BLOCK, "cpu", staging_pages=16,
                      direct=True, host_layout=request.param)
    assert rt.cache.host_pool.host_layout == request.param
    yield rt
    rt.close(5.0)


def _check(save_kind, load_kind, source, target, count, block=BLOCK):
    check_moved(save_kind, load_kind, source, target, slots(OLD, block, count),
                slots(NEW, block, count), HEADS, DIM)


def _check_canonical(runtime, kind, source, tokens):
    """Every host page holds its tokens' K then V rows of every layer in kvtier's order."""
    with runtime.lock:
        held = runtime.cache.hold_host(runtime.cache.match(tokens))
    try:
        host = runtime.cache.host_pool     # its own byte arithmetic, not the connector's view
        for layer, name in enumerate(runtime.shape.layer_names):
            layout = block_layout(BACKENDS[kind], source[name], HEADS, DIM)
            for page, host_id in enumerate(held.host_page_ids):
                rows = layout.read(source[name], slots(OLD, BLOCK, len(tokens))[
                    page * BLOCK:(page + 1) * BLOCK])
                for part, want in enumerate(rows):
                    got = host.part(host_id, layer, part).view(torch.int16).view(want.shape)
                    assert torch.equal(got, as_words(want)), (layer, page, part)
    finally:
        with runtime.lock:
            runtime.cache.release(held)


def _check_no_staging(runtime):
    stats = runtime.cache.stats()["counters"]
    assert runtime.cache.device_pool.num_pages == 1
    assert stats.get("load_back_pages_total", 0) == 0 and stats.get("commit_total", 0) == 0
    assert stats["host_fill_pages_total"] > 0 and stats["hold_total"] > 0


@interpreted
@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_the_kernel_moves_blocks_to_host_pages_and_back_byte_exact(runtime, kind):
    count = len(OLD) * BLOCK
    tokens = _prompt(count + 3)
    worker, source, target = direct_round_trip(runtime, kind, kind, NUM_BLOCKS, "cpu", tokens,
                                               OLD, NEW, count - 5, use_kernels=True)
    assert worker.blocks is not None and worker.direct is not None
    # The claim's last block moves whole (its page is held): the request computes the rest.
    _check(kind, kind, source, target, count)
    _check_canonical(runtime, kind, source, tokens[:count])
    _check_no_staging(runtime)


@pytest.mark.parametrize("kind", ["nhd", "hnd", "cpu"])
def test_torch_gathers_move_blocks_to_host_pages_and_back_byte_exact(runtime, kind):
    count = len(OLD) * BLOCK
    tokens = _prompt(count)
    worker, source, target = direct_round_trip(runtime, kind, kind, NUM_BLOCKS, "cpu", tokens,
                                               OLD, NEW, count - 5, use_kernels=False)
    assert worker.blocks is None
    _check(kind, kind, source, target, count)
    _check_canonical(runtime, kind, source, tokens)
    _check_no_staging(runtime)


@pytest.mark.parametrize("save_kind,load_kind", [("nhd", "cpu"), ("cpu", "hnd")])
def test_a_prompt_saved_from_one_backend_loads_into_another(runtime, save_kind, load_kind):
    count = len(OLD) * BLOCK
    _, source, target = direct_round_trip(runtime, save_kind, load_kind, NUM_BLOCKS, "cpu",
                                          _prompt(count), OLD, NEW, count, use_kernels=False)
    _check(save_kind, load_kind, source, target, count)


def test_held_host_pages_are_released_after_the_step_that_read_them(runtime):
    count = len(OLD) * BLOCK
    tokens = _prompt(count)
    direct_round_trip(runtime, "cpu", "cpu", NUM_BLOCKS, "cpu", tokens, OLD, NEW, count,
                      use_kernels=False)
    assert "r" not in runtime.staged
    with runtime.lock:
        runtime.cache.check_integrity()
        # Nothing holds the prompt's host pages any more: clearing the tier takes them.
        runtime.cache.clear_tier("host")
        assert runtime.cache.match(tokens).tokens_by_tier["host"] == 0


def test_a_save_kvtier_holds_already_writes_nothing(runtime):
    count = len(OLD) * BLOCK
    tokens = _prompt(count)
    worker, _, _ = direct_round_trip(runtime, "cpu", "cpu", NUM_BLOCKS, "cpu", tokens, OLD, NEW,
                                     count, use_kernels=False)
    before = runtime.cache.stats()["counters"]["host_fill_pages_total"]
    worker.wait_for_save(Step(saves=[SaveSpec("again", tuple(tokens), None, OLD)]))
    assert runtime.counts["saves_skipped_held"] == 1
    assert runtime.cache.stats()["counters"]["host_fill_pages_total"] == before


def test_direct_options_are_checked():
    options = parse_connector_config({"direct": True}, 16)
    assert options.direct and options.config.cache.device_pages == 1
    assert not options.staging_from_default
    with pytest.raises(ConfigError, match="direct"):
        parse_connector_config({"direct": "yes"}, 16)
    with pytest.raises(ConfigError, match="staging_pages"):
        parse_connector_config({"direct": True, "staging_pages": 64}, 16)


class _Pending:
    """A copy still on the bus until ``land()``; records a stream made to wait for it."""

    def __init__(self) -> None:
        self.landed = False
        self.waited_on: list[object] = []

    def is_done(self) -> bool:
        return self.landed

    def wait(self, timeout_s: float | None = None) -> bool:
        self.landed = True
        return True

    def stream_wait(self, device: object) -> None:
        self.waited_on.append(device)


def _worker_with_pending_copies(runtime, monkeypatch):
    count = len(OLD) * BLOCK
    tokens = _prompt(count)
    worker, _, _ = direct_round_trip(runtime, "cpu", "cpu", NUM_BLOCKS, "cpu", tokens, OLD, NEW,
                                     count, use_kernels=False)
    pending = _Pending()
    monkeypatch.setattr(worker.direct, "save", lambda spec: pending)
    monkeypatch.setattr(worker.direct, "load", lambda spec, held: pending)
    return worker, tokens, pending


def test_a_finished_requests_blocks_are_reported_free_only_once_its_save_is_over(
        runtime, monkeypatch):
    worker, tokens, pending = _worker_with_pending_copies(runtime, monkeypatch)
    worker.wait_for_save(Step(saves=[SaveSpec("s", tuple(_prompt(40)), None, OLD[:2])]))
    assert worker.get_finished({"s"}) is None
    worker.wait_for_save(Step(held=["s"]))
    assert worker.get_finished(set()) is None            # still read by its save
    pending.landed = True
    assert worker.get_finished(set()) == {"s"}
    assert worker.get_finished(set()) is None            # reported once


def test_a_preempted_requests_blocks_are_reused_only_after_its_save(runtime, monkeypatch):
    worker, tokens, pending = _worker_with_pending_copies(runtime, monkeypatch)
    worker.wait_for_save(Step(saves=[SaveSpec("p", tuple(_prompt(40)), None, OLD[:2])]))
    worker.handle_preemptions(Step(preempted=["p"]))
    assert pending.waited_on == [worker.direct.device]


def test_a_load_is_reported_received_once_its_copy_is_over(runtime, monkeypatch):
    worker, tokens, pending = _worker_with_pending_copies(runtime, monkeypatch)
    with runtime.lock:
        runtime.staged["q"] = runtime.cache.hold_host(runtime.cache.match(tokens))
    worker.start_load_kv(Step(loads=[LoadSpec("q", 0, 40, NEW[:3])]))
    assert worker.take_received() is None
    with runtime.lock:      # the held pages are pinned while the copy reads them
        runtime.cache.clear_tier("host")
        assert runtime.cache.match(tokens).tokens_by_tier["host"] == len(tokens)
    pending.landed = True
    assert worker.take_received() == {"q"}
    with runtime.lock:
        runtime.cache.clear_tier("host")
        assert runtime.cache.match(tokens).tokens_by_tier["host"] == 0


@interpreted
def test_saves_run_on_the_host_tiers_store_grid_and_loads_on_every_sm(runtime):
    count = len(OLD) * BLOCK
    worker, _, _ = direct_round_trip(runtime, "nhd", "nhd", NUM_BLOCKS, "cpu", _prompt(count),
                                     OLD, NEW, count, use_kernels=True)
    assert runtime.options.config.host.store_programs == 4      # the connector's default
    assert worker.direct.blocks._store.max_programs == 4
    assert worker.direct.blocks._load.max_programs is None       # one program per SM


@interpreted
@pytest.mark.parametrize("chunk_pages", [2, 64], ids=["chunked", "one_chunk"])
def test_loads_through_the_copy_engines_are_byte_exact(runtime, monkeypatch, chunk_pages):
    """On CUDA the copy engines move whole host pages into a device buffer and the row kernel
    scatters them into vLLM's blocks; here a host memmove stands in for the copy engines."""
    from kvtier.integrations.vllm import direct
    from kvtier.transfer.ce_batch import host_memmove

    monkeypatch.setattr(direct, "engine_copies", lambda device, path: host_memmove())
    options, page_bytes = runtime.options, runtime.cache.host_pool.layout.page_bytes
    host = dataclasses.replace(options.config.host, copy_staging_bytes=chunk_pages * page_bytes)
    runtime.options = dataclasses.replace(
        options, config=dataclasses.replace(options.config, host=host))
    count = len(OLD) * BLOCK
    worker, source, target = direct_round_trip(runtime, "hnd", "nhd", NUM_BLOCKS, "cpu",
                                               _prompt(count), OLD, NEW, count - 5,
                                               use_kernels=True)
    if runtime.cache.host_pool.host_layout == "page_first":
        assert worker.direct.bounce is not None and worker.direct.bounce.pages == chunk_pages
    else:                           # a page's layers are apart there: the row kernel reads
        assert worker.direct.bounce is None
    _check("hnd", "nhd", source, target, count)
