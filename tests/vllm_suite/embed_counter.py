"""A forward hook on the model's embedding that counts the prompt tokens the model really ran.

Installed and read through ``LLM.apply_model`` by ``scenario.py``: the functions are sent to the
process that runs the model (vLLM's worker, or each TP rank) by reference, so they live in this
importable module rather than in the scenario script (whose ``__main__`` differs per process).
"""

from __future__ import annotations

from typing import Any


def install(model: Any) -> None:
    embed = model.model.embed_tokens
    embed.kvtier_tokens = [0]

    def hook(module: Any, args: Any, output: Any) -> None:
        module.kvtier_tokens[0] += int(args[0].numel())
    embed.register_forward_hook(hook)


def read(model: Any) -> int:
    return int(model.model.embed_tokens.kvtier_tokens[0])
