"""Prompts for ``kvtier bench serve``: random, shared-prefix groups, multi-turn from a trace or
synthetic.

Owns ``ServeRequest`` (token-id prompt, tokens to generate, a tenant) and the four workload
builders. Prompts are token ids, so every server gets exactly the same tokens whatever its
tokenizer. Ids come from seeded ``random.Random`` streams, identical across processes.

``multi_turn`` replays conversations of the Mooncake trace (``timestamp``, ``input_length``,
``output_length``, ``hash_ids``: one id per 512-token block, equal ids = equal content): each
block id becomes a fixed run of ``block_tokens`` token ids, a prompt is its blocks' runs in
order cut to its input length scaled by ``block_tokens / 512``, so the trace's lengths and its
prefix structure (which turns share which leading blocks) carry over at any scale. Whole
conversations are taken (their turns are minutes apart in the trace, so the trace's first
requests alone would share little more than the system block).

``conversations`` builds multi-turn chats without a trace: every turn re-sends the whole
history (a system prompt all conversations share, then each earlier turn's user message and a
reply) plus a new user message. The replies are fixed seeded tokens standing for the
assistant's earlier answers, not what a server generated, so every server gets the same
prompts. Main thread.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512   # the Mooncake trace's block size
FIRST_ID = 10              # token ids below are left alone (special tokens sit there)


@dataclass(frozen=True)
class ServeRequest:
    prompt: tuple[int, ...]
    max_tokens: int
    tenant: str = ""


def _ids(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(count)]


def random_prompts(count: int, input_len: int, output_len: int, vocab: int,
                   seed: int = 0) -> list[ServeRequest]:
    """``count`` unrelated prompts of ``input_len`` tokens."""
    rng = random.Random(f"random-{seed}")
    return [ServeRequest(tuple(_ids(rng, input_len, vocab)), output_len) for _ in range(count)]


def shared_prefix(count: int, groups: int, prefix_len: int, input_len: int, output_len: int,
                  vocab: int, seed: int = 0) -> list[ServeRequest]:
    """Request ``i`` is group ``i % groups``'s prefix then ``input_len`` tokens of its own."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    rng = random.Random(f"shared-{seed}")
    prefixes = [_ids(rng, prefix_len, vocab) for _ in range(groups)]
    return [ServeRequest(tuple(prefixes[i % groups] + _ids(rng, input_len, vocab)), output_len,
                         tenant=f"group-{i % groups}") for i in range(count)]


def multi_turn(trace: Path, count: int, block_tokens: int, max_output: int,
               vocab: int) -> list[ServeRequest]:
    """About ``count`` requests: every turn of the trace's first conversations with two turns or
    more, in timestamp order. A conversation is named by its second block (every request of
    the trace starts with the same first block, a shared system prompt)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    conversations: dict[int, list[dict]] = {}
    with open(trace) as lines:
        for line in lines:
            record = json.loads(line)
            if len(record["hash_ids"]) > 1:
                conversations.setdefault(int(record["hash_ids"][1]), []).append(record)
    chosen: list[dict] = []
    for turns in conversations.values():
        if len(chosen) >= count:
            break
        if len(turns) >= 2:
            chosen += turns
    if not chosen:
        raise ValueError(f"{trace} has no conversation of two turns or more")
    chosen.sort(key=lambda record: record["timestamp"])
    scale = block_tokens / TRACE_BLOCK_TOKENS
    return [_turn(record, block_tokens, scale, max_output, vocab) for record in chosen]


def _turn(record: dict, block_tokens: int, scale: float, max_output: int,
          vocab: int) -> ServeRequest:
    tokens = [t for h in record["hash_ids"] for t in _block(int(h), block_tokens, vocab)]
    length = max(1, min(len(tokens), round(record["input_length"] * scale)))
    new = max(1, min(max_output, round(record["output_length"] * scale)))
    return ServeRequest(tuple(tokens[:length]), new, tenant=f"conversation-{record['hash_ids'][1]}")


def _block(hash_id: int, block_tokens: int, vocab: int) -> list[int]:
    return _ids(random.Random(f"block-{hash_id}"), block_tokens, vocab)


def conversations(count: int, turns: int, system_len: int, user_len: int, reply_len: int,
                  output_len: int, vocab: int, seed: int = 0) -> list[ServeRequest]:
    """``count`` conversations of ``turns`` turns, turn by turn: all first turns (conversation
    order), then all second turns, and so on. Turn ``t`` (from 0) of a conversation is the shared
    ``system_len``-token system prompt, then for each earlier turn its ``user_len``-token user
    message and ``reply_len``-token reply, then turn ``t``'s user message: ``system_len + (t + 1)
    * user_len + t * reply_len`` tokens, the previous turn's prompt being its prefix."""
    if count < 1 or turns < 1:
        raise ValueError(f"count and turns must be >= 1, got {count} and {turns}")
    rng = random.Random(f"conversations-{seed}")
    system = _ids(rng, system_len, vocab)
    chats = [[(_ids(rng, user_len, vocab), _ids(rng, reply_len, vocab)) for _ in range(turns)]
             for _ in range(count)]
    out = []
    for turn in range(turns):
        for c, chat in enumerate(chats):
            history = [t for user, reply in chat[:turn] for t in (*user, *reply)]
            out.append(ServeRequest(tuple(system + history + chat[turn][0]), output_len,
                                    tenant=f"conversation-{c}"))
    return out
