"""Pure prefix-cache simulation for the vLLM stand-in.

Mirrors how vLLM v1 accounts prefix caching so the supervisor sees counters with real semantics:
prompts are cut into full blocks whose hashes chain on the parent block (a shared prefix hits, a
changed early token misses everything after it), the local (HBM) cache is a small LRU, and a KV
connector store (openYuanrong) is a larger LRU consulted only for the blocks missed locally.
Everything is counted in tokens, and at least the last prompt token is always recomputed.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_TOKEN_RE = re.compile(r"\w{1,8}|[^\w\s]")
_ROOT_HASH = 0x5EED


def tokenize(text: str) -> list[str]:
    """Words (split every 8 characters) and punctuation; close enough to BPE for counting."""
    return _TOKEN_RE.findall(text)


def block_hashes(tokens: Sequence[str], block_size: int) -> list[int]:
    """Chained hashes of the full blocks, like vLLM's hash_block_tokens (builtin-hash flavour)."""
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


class LruBlockStore:
    """A bounded set of block hashes; the least recently used is evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def touch(self, block_hash: int) -> None:
        self._blocks.move_to_end(block_hash)

    def add(self, block_hash: int) -> None:
        if self.capacity == 0:
            return
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        self._blocks[block_hash] = None
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def leading_hits(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`, from the first, are present (a prefix match stops at the first miss)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            count += 1
        return count


@dataclass(frozen=True)
class Lookup:
    """One request's prefix-cache accounting, in tokens, as vLLM's scheduler records it."""

    num_tokens: int
    local_hit_tokens: int
    external_query_tokens: int
    external_hit_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.local_hit_tokens + self.external_hit_tokens


class PrefixCacheSim:
    """Local LRU plus optional external store; `external_blocks=0` means no KV connector."""

    def __init__(self, block_size: int = 16, local_blocks: int = 256, external_blocks: int = 16384) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.local = LruBlockStore(local_blocks)
        self.external: LruBlockStore | None = LruBlockStore(external_blocks) if external_blocks > 0 else None

    def lookup(self, tokens: Sequence[str]) -> Lookup:
        """Find the cached prefix of a new request (vLLM's get_computed_blocks + connector match)."""
        num_tokens = len(tokens)
        hashes = block_hashes(tokens, self.block_size)
        max_hit_blocks = max(0, (num_tokens - 1) // self.block_size)
        candidates = hashes[:max_hit_blocks]
        local_blocks = self.local.leading_hits(candidates)
        for block_hash in candidates[:local_blocks]:
            self.local.touch(block_hash)
        local_tokens = local_blocks * self.block_size
        if self.external is None:
            return Lookup(num_tokens, local_tokens, 0, 0)
        external_blocks = self.external.leading_hits(candidates[local_blocks:])
        for block_hash in candidates[local_blocks : local_blocks + external_blocks]:
            self.external.touch(block_hash)
        return Lookup(
            num_tokens=num_tokens,
            local_hit_tokens=local_tokens,
            external_query_tokens=num_tokens - local_tokens,
            external_hit_tokens=external_blocks * self.block_size,
        )

    def store(self, tokens: Sequence[str]) -> None:
        """Cache every full block of `tokens` locally and save it to the external store."""
        for block_hash in block_hashes(tokens, self.block_size):
            self.local.add(block_hash)
            if self.external is not None:
                self.external.add(block_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
