"""The paged KV cache's bookkeeping: blocks, a free list, ref counts, prefix caching.

Pure Python, no torch. The KV cache is ``num_blocks`` blocks of ``block_size``
token slots; a request owns a list of block IDs (its block table) and token
``p`` of the request lives in slot ``block_ids[p // block_size] * block_size +
p % block_size``.

Prefix caching: a full block is named by a chained digest of (the digest of
the block before it, the block's token IDs), so equal digests mean equal
prefixes. The digest is cryptographic (BLAKE2b, 256 bits): a crafted prompt
cannot collide with another user's prefix and be served their KV cache, as it
could with Python's 64-bit ``hash`` (vLLM's CVE-2025-25183). The chain starts
from a root key of the request's ``cache_salt``, so tenants with different
salts never share a block. Blocks whose ref count drops to zero keep their
digest and stay findable until the free list hands them out again, oldest
first (LRU).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Optional, Sequence

from backend.core.request import Request

BLOCK_KEY_BYTES = 32  # 256-bit digests: 128-bit collision resistance


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=BLOCK_KEY_BYTES).digest()


def root_key(cache_salt: Optional[str] = None, extra_keys: bytes = b"") -> bytes:
    """The parent key of a request's first block: its salt and any other keys that must
    match for two prefixes to share KV (a future LoRA or image digest goes in ``extra_keys``).

    Each part is length-prefixed, so no two (salt, extra) pairs give the same input.
    """
    salt = b"" if cache_salt is None else b"\x01" + cache_salt.encode()
    parts = (b"tandem/prefix-cache/v1", salt, extra_keys)
    return _digest(b"".join(len(part).to_bytes(8, "little") + part for part in parts))


_UNSALTED_ROOT = root_key()


def hash_block(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of one full block: BLAKE2b-256 over the parent's key (32 bytes) and the block's
    token IDs as uint32s (native order: keys never leave the process). The parent's fixed
    length frames the input."""
    return _digest(parent_key + array("I", token_ids).tobytes())


class KVBlock:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Optional[bytes] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockManager:
    """Hands out KV-cache blocks to requests and finds cached prefixes.

    Contract: ``allocate_slots`` either reserves every slot asked for or changes
    nothing and returns False; ``free`` returns all of a request's blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in the order they are handed out (front first).
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block key -> block ID
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_hashed_blocks: dict[str, int] = {}  # leading blocks already registered
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's live block table: appended to while it holds blocks, a new list after a free."""
        return self.req_blocks.get(request_id, [])

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            if hashes:
                parent = hashes[-1]
            elif request.cache_salt is None:
                parent = _UNSALTED_ROOT
            else:
                parent = root_key(request.cache_salt)
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a new request: (block IDs, number of tokens).

        At least one token is always left to compute, so the step produces logits.
        Requests that want prompt logprobs get no hits (their logits are needed).
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ---- allocation ------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed and in-flight tokens.

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``)
        that start the block table of a request holding no blocks yet.
        """
        held = self.req_blocks.setdefault(request.request_id, [])
        if not new_computed_blocks:  # the common case (a decode): often no new block at all
            end = request.num_computed_tokens + request.num_inflight_tokens + num_new_tokens
            if end <= len(held) * self.block_size:
                return True
        num_computed = (request.num_computed_tokens + request.num_inflight_tokens
                        + len(new_computed_blocks) * self.block_size)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(held) - len(new_computed_blocks)
        # Hits that sit in the free list stop being free once touched.
        num_free_hits = sum(1 for b in new_computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > len(self.free_blocks) - num_free_hits:
            if not held:
                del self.req_blocks[request.request_id]
            return False
        for block_id in new_computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
        held.extend(new_computed_blocks)
        if new_computed_blocks:
            self.req_num_hashed_blocks[request.request_id] = len(new_computed_blocks)
        for _ in range(max(num_new_blocks, 0)):
            held.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed, for later hits."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self.req_num_hashed_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        held = self.req_blocks[rid]
        for i in range(start, num_full):
            block_hash = request.block_hashes[i]
            block = self.blocks[held[i]]
            if block_hash not in self.cached_blocks and block.block_hash is None:
                self.cached_blocks[block_hash] = block.block_id
                block.block_hash = block_hash
        self.req_num_hashed_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Drop the request's hold on its blocks; unshared ones become free.

        Cached blocks go to the back of the free list tail-first (so a prefix
        outlives its suffix); blocks without a hash go to the front (reused first).
        """
        held = self.req_blocks.pop(request.request_id, [])
        self.req_num_hashed_blocks.pop(request.request_id, None)
        for block_id in reversed(held):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        if self.req_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
