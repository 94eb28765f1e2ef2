"""The prefix-hash scheme: full blocks only, chained, adapter-seeded, stable across processes, and
sharing exactly where vLLM's own block hashes share."""
from __future__ import annotations

import os
import subprocess
import sys

from serve_deployments.prefix_hash import block_hashes, cacheable_blocks, route_key

BS = 128


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 509 for i in range(n)]


def test_full_blocks_only():
    assert block_hashes(list(range(127)), BS) == []
    assert len(block_hashes(list(range(128)), BS)) == 1
    assert len(block_hashes(list(range(300)), BS)) == 2
    assert len(block_hashes(list(range(300)), 16)) == 18


def test_chained_and_adapter_seeded():
    shared = _prompt(1, 128)
    a, b = shared + _prompt(2, 128), shared + _prompt(3, 128)
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    # Same second block after a different first block: chained, so nothing is shared.
    c = _prompt(4, 128) + a[128:]
    assert not set(block_hashes(c, BS)) & set(ha)
    # Different adapters (and the base model) never share a block.
    h1, h2 = block_hashes(a, BS, "policy-v1"), block_hashes(a, BS, "policy-v2")
    assert not set(h1) & set(h2) and not set(h1) & set(ha)
    # Merge mode: a new base generation shares nothing with the old one.
    assert not set(block_hashes(a, BS, None, salt="merged-v3")) & set(ha)


def test_cacheable_blocks_like_vllm():
    # vLLM recomputes the last prompt token, so a prompt of exactly k blocks can hit only k - 1.
    assert cacheable_blocks(256, BS) == 1
    assert cacheable_blocks(257, BS) == 2
    assert cacheable_blocks(1, BS) == 0 and cacheable_blocks(0, BS) == 0
    key = route_key(list(range(300)), BS, "policy-v1")
    assert key["hit_cap"] == 2 and len(key["hashes"]) == 2 and key["block_size"] == BS


def test_stable_across_processes():
    code = ("from serve_deployments.prefix_hash import block_hashes;"
            "print(block_hashes(list(range(400)), 128, 'policy-v7'))")
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {str(block_hashes(list(range(400)), 128, "policy-v7"))}


def test_shares_exactly_where_vllm_shares():
    """Build vLLM's own block hashes (sha256, LoRA extra keys) for prompts that share prefixes under
    several adapters; ours must partition the (prompt, adapter, block) triples the same way."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)

    def vllm_hashes(tokens, adapter):
        extra = (("lora", adapter, f"/tmp/{adapter}"),) if adapter else None
        out, parent = [], None
        for i in range(len(tokens) // BS):
            parent = hash_block_tokens(sha256, parent, tokens[i * BS:(i + 1) * BS], extra)
            out.append(parent)
        return out

    sys_prompt = _prompt(9, 200)
    prompts = [sys_prompt + _prompt(s, 150 + 40 * s) for s in range(4)] + [_prompt(5, 400), sys_prompt[:130]]
    ours, theirs = {}, {}
    for pi, p in enumerate(prompts):
        for adapter in ("", "policy-v1", "policy-v2"):
            for bi, (h_o, h_v) in enumerate(zip(block_hashes(p, BS, adapter or None), vllm_hashes(p, adapter))):
                ours.setdefault(h_o, set()).add((pi, adapter, bi))
                theirs.setdefault(h_v, set()).add((pi, adapter, bi))
    assert sorted(map(sorted, ours.values())) == sorted(map(sorted, theirs.values()))
    assert any(len(v) > 1 for v in ours.values())  # the case is not trivially all-distinct
