"""``kvtier serve``: the OpenAI-compatible server on the reference engine with the tiered cache.

Builds the config (defaults < ``--config`` YAML < ``KVTIER_*`` env < flags), refuses settings
that cannot take effect before anything loads (``serve.preflight``), then binds, loads the model
and serves HTTP until interrupted (``serve.lifecycle``), printing how to call it once the port
accepts connections. ``--no-cache`` runs the same engine with kvtier off (the baseline).
``--log-level`` (``server.log_level``) sets the level of kvtier's and uvicorn's log lines. Main
thread.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.config_flags import add_config_flags, config_from_args, explicit_paths


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="Serve the OpenAI API with the tiered KV cache.",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models and /health on the "
                    "reference engine (transformers) with kvtier's tiered KV cache.")
    parser.add_argument("--no-cache", action="store_true",
                        help="Run the same engine with kvtier off (sets cache.enabled=false).")
    add_config_flags(parser)
    parser.set_defaults(handler=run)


#: Longer than a page (64 tokens by default: 116 tokens with the embedded tokenizer), so the
#: second time it is sent, part of it comes from the cache.
DEMO_PROMPT = ("kvtier keeps the KV cache of every prompt it has seen on the GPU, in host memory "
               "and on disk, so a request whose prompt starts like an earlier one loads the "
               "shared part instead of computing it again. Send this prompt twice and compare "
               "the cached tokens.")


def how_to_call(base: str, config: KvtierConfig, model: str) -> str:
    auth = ' -H "Authorization: Bearer $KEY"' if config.server.api_key else ""
    return "\n".join([
        f"kvtier serving {model} at {base}",
        f"  curl {base}/v1/models{auth}",
        f"  curl {base}/v1/completions{auth} -H 'Content-Type: application/json' \\",
        f"       -d '{{\"model\": \"{model}\", \"prompt\": \"{DEMO_PROMPT}\", "
        "\"max_tokens\": 16, \"temperature\": 0}'",
        "  python (pip install openai): openai.OpenAI(base_url=\"" + base + "/v1\", "
        "api_key=\"...\").completions.create(model=\"" + model + "\", prompt=\"...\")",
        "  Sent twice, usage.prompt_tokens_details.cached_tokens tells how much of the prompt "
        "came from the cache.",
    ])


def run(args: argparse.Namespace) -> int:
    if args.no_cache:
        setattr(args, "cfg:cache.enabled", "false")
    config = config_from_args(args)
    from kvtier.serve.preflight import check_settings

    check_settings(config)
    name = _model_name(config)
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from kvtier.serve.lifecycle import serve

    def ready(base: str) -> None:
        print(how_to_call(base, config, name), flush=True)

    serve(config, explicit_paths(args), ready=ready)
    return 0


def _model_name(config: KvtierConfig) -> str:
    """The name answers carry: the first of ``server.served_model_name``, else the model's."""
    from kvtier.engine.presets import resolve_model
    from kvtier.serve.openai_api import served_names

    return served_names(config, resolve_model(config.engine.model).name)[0]
