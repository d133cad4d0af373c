"""A vLLM KV connector that does nothing: the benchmark's baseline for having any connector.

vLLM runs extra work for every configured connector (metadata each step, the connector's hooks
around each layer); ``NoopConnector`` answers every hook with nothing to do, so an engine with it
against one without measures that work, and kvtier's connector against it kvtier's own. Loaded by
``scenario.py`` through ``kv_connector_module_path``; runs on the threads vLLM calls it from.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):
    """Claims no tokens, loads and saves nothing."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
