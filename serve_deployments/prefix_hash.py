"""The prefix-hash scheme the router routes by: one module, imported by the router and its tests.

It mirrors vLLM's prefix cache (vllm/v1/core/kv_cache_utils.py `get_request_block_hasher`): only *full*
blocks of the engine's block size are hashed, each hash chains its parent's, and requests under
different adapters never share a hash (vLLM adds `("lora", name, path)` as an extra key to every
block; seeding the chain's root with the adapter name separates the chains the same way). The values
differ from vLLM's own (the router never sees the engine's hashes); what must agree is which prompts
share which blocks, and that is what the chaining + seed reproduce.

Hashes are 64-bit ints from blake2b over the token bytes, never Python's `hash()`: the same prompt must
map to the same blocks in every process (ingress replicas, benchmarks, tests).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_DOMAIN = b"lora-grpo/prefix/1\0"


def root_hash(adapter: str | None, salt: str = "") -> bytes:
    """Parent of a chain's first block: base model (None) and every adapter name get distinct roots.
    `salt` separates base-model generations (merge mode replaces the base weights under one name)."""
    name = "\0base" if adapter is None else adapter
    return hashlib.blake2b(_DOMAIN + name.encode() + b"\0" + salt.encode(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
                 salt: str = "") -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block has none: vLLM caches
    only full blocks)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    data = array("q", token_ids[: n_full * block_size]).tobytes()
    step = block_size * 8
    parent = root_hash(adapter, salt)
    out = []
    for i in range(n_full):
        parent = hashlib.blake2b(parent + data[i * step:(i + 1) * step], digest_size=16).digest()
        out.append(int.from_bytes(parent[:8], "little"))
    return out


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks of a prompt vLLM can serve from its cache: it always recomputes the last prompt token
    (`max_cache_hit_length = num_tokens - 1` in KVCacheManager.get_computed_blocks)."""
    return max(0, num_tokens - 1) // block_size


def route_key(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
              salt: str = "") -> dict:
    """What travels with a request for the router: its block hashes and how many can hit the cache."""
    return {"hashes": block_hashes(token_ids, block_size, adapter, salt),
            "hit_cap": cacheable_blocks(len(token_ids), block_size),
            "block_size": block_size}
