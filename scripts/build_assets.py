"""Rebuild the tiny model assets shipped in ``kvtier/engine/assets/`` (tokenizer + configs).

Owns the recipe behind the embedded default model: a byte-level BPE tokenizer trained on the
docstrings of the Python standard library (present on every machine, so the recipe needs no
download), and small Llama and Qwen2 configs sized to it. The shipped files are the artifact;
run ``python scripts/build_assets.py [TARGET]`` only to change them. Main thread, offline.
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "src" / "kvtier" / "engine" / "assets"
VOCAB_SIZE = 1024
CORPUS_LIMIT_BYTES = 6 << 20
SPECIAL_TOKENS = ("<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = {
    "hidden_act": "silu",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_cache": True,
}


def _docstrings() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def corpus() -> list[str]:
    """Standard-library docstrings, in a fixed order, up to ``CORPUS_LIMIT_BYTES``."""
    out, size = [], 0
    for doc in _docstrings():
        out.append(doc)
        size += len(doc)
        if size >= CORPUS_LIMIT_BYTES:
            break
    return out


def build_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id("<|bos|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)])
    return tokenizer


def model_configs(tokenizer: Any) -> dict[str, dict[str, Any]]:
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    special = {"vocab_size": tokenizer.get_vocab_size(), "bos_token_id": ids["<|bos|>"],
               "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
               "pad_token_id": ids["<|pad|>"]}
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_COMMON, **special,
             "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False}
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_COMMON, **special,
             "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None}
    return {"tiny-llama": llama, "tiny-qwen2": qwen2}


def write_assets(target: Path = ASSETS) -> None:
    tokenizer = build_tokenizer(corpus())
    tok_dir = target / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
        "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "unk_token": None,
        "additional_special_tokens": ["<|endoftext|>", "<|im_start|>"],
        "model_max_length": 32768, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    for name, config in model_configs(tokenizer).items():
        (target / f"{name}.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_assets(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
