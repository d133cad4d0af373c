"""``kvtier serve``: the OpenAI-compatible server on the reference engine with the tiered cache.

Builds the config (defaults < ``--config`` YAML < ``KVTIER_*`` env < flags), loads the model,
starts the engine thread and serves HTTP with uvicorn until interrupted, after printing how to
call it. ``--no-cache`` runs the same engine with kvtier off (the baseline). Main thread.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvtier.config import KvtierConfig, add_config_flags, config_from_args


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="Serve the OpenAI API with the tiered KV cache.",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models and /health on the "
                    "reference engine (transformers) with kvtier's tiered KV cache.")
    parser.add_argument("--no-cache", action="store_true",
                        help="Run the same engine with kvtier off (sets cache.enabled=false).")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


def how_to_call(base: str, config: KvtierConfig, model: str) -> str:
    auth = ' -H "Authorization: Bearer $KEY"' if config.server.api_key else ""
    return "\n".join([
        f"kvtier serving {model} at {base}",
        f"  curl {base}/v1/models{auth}",
        f"  curl {base}/v1/completions{auth} -H 'Content-Type: application/json' \\",
        f"       -d '{{\"model\": \"{model}\", \"prompt\": \"Return the\", \"max_tokens\": 16}}'",
        "  python: openai.OpenAI(base_url=\"" + base + "/v1\", api_key=\"...\")"
        ".completions.create(model=\"" + model + "\", prompt=\"...\")",
        "  usage.prompt_tokens_details.cached_tokens tells how much of a prompt came from the cache.",
    ])


def run(args: argparse.Namespace) -> int:
    if args.no_cache:
        setattr(args, "cfg:cache.enabled", "false")
    flags_config = config_from_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvtier.serve.app import serve

    def ready(base: str) -> None:
        print(how_to_call(base, flags_config, _model_name(flags_config)), flush=True)

    serve(flags_config, ready=ready)
    return 0


def _model_name(config: KvtierConfig) -> str:
    from kvtier.engine.presets import resolve_model

    return resolve_model(config.engine.model).name
