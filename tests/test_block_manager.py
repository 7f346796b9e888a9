"""BlockManager: exact block IDs, ref counts, prefix hits, eviction order, the key function."""

import hashlib
import struct

from backend.core.block_manager import BlockManager, hash_block, root_key
from backend.core.request import Request
from backend.types.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], cache_salt=None, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), eos_token_id=None, cache_salt=cache_salt)


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a", list(range(10)))
    assert bm.allocate_slots(req, 10)
    assert bm.block_ids("a") == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    req.num_computed_tokens = 10
    assert bm.allocate_slots(req, 2)  # 12 tokens: still 3 blocks
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.allocate_slots(req, 3)  # 13 tokens: a 4th block
    assert bm.block_ids("a") == [0, 1, 2, 3]
    bm.free(req)
    assert refs(bm) == [0] * 8
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    b = make_request("b", list(range(100, 108)))
    assert not bm.allocate_slots(b, 8)  # needs 2 blocks, 1 is free
    assert bm.block_ids("b") == []
    assert bm.num_free_blocks == 1
    assert refs(bm) == [1, 1, 0]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    assert bm.get_computed_blocks(a) == ([], 0)
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a, 10)
    assert bm.block_ids("a") == [0, 1, 2]

    b = make_request("b", prompt[:8] + [77, 78, 79])
    hits, num_tokens = bm.get_computed_blocks(b)
    assert (hits, num_tokens) == ([0, 1], 8)
    assert bm.allocate_slots(b, 3, hits)
    assert bm.block_ids("b") == [0, 1, 3]
    assert refs(bm)[:4] == [2, 2, 1, 1]

    bm.free(a)
    assert refs(bm)[:4] == [1, 1, 0, 1]
    bm.free(b)
    assert refs(bm) == [0] * 10


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    assert bm.allocate_slots(a, 8)
    bm.cache_full_blocks(a, 8)
    bm.free(a)
    b = make_request("b", list(range(8)))
    hits, num_tokens = bm.get_computed_blocks(b)
    assert (hits, num_tokens) == ([0], 4)  # block 1 is cached too, but one token must run


def test_freed_cached_blocks_are_hits_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    assert bm.block_ids("a") == [0, 1, 2]
    bm.cache_full_blocks(a, 5)  # blocks 0 and 1 are full
    bm.free(a)
    # Free list: unhashed block 2 first, then 3, then the cached ones tail-first (1 before 0).
    assert list(bm.free_blocks) == [2, 3, 1, 0]

    b = make_request("b", [1, 2, 3, 4, 9])
    hits, n = bm.get_computed_blocks(b)
    assert (hits, n) == ([0, 1], 4)
    assert bm.allocate_slots(b, 1, hits)
    assert bm.block_ids("b") == [0, 1, 2]
    bm.free(b)

    # A request needing every block evicts the cached ones; their hashes are gone.
    c = make_request("c", list(range(100, 108)))
    assert bm.allocate_slots(c, 8)
    assert sorted(bm.block_ids("c")) == [0, 1, 2, 3]
    assert bm.cached_blocks == {}
    bm.free(c)
    d = make_request("d", [1, 2, 3, 4, 5])
    assert bm.get_computed_blocks(d) == ([], 0)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    assert bm.allocate_slots(a, 9)
    bm.cache_full_blocks(a, 9)
    bm.free(a)
    assert bm.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_prompt_logprobs_requests_skip_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    assert bm.allocate_slots(a, 9)
    bm.cache_full_blocks(a, 9)
    b = make_request("b", list(range(9)), prompt_logprobs=1)
    assert bm.get_computed_blocks(b) == ([], 0)


def test_hit_on_a_free_block_counts_against_free_space():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3])
    assert bm.allocate_slots(a, 3)  # blocks 0, 1
    bm.cache_full_blocks(a, 3)
    bm.free(a)
    b = make_request("b", [1, 2, 5, 6, 7, 8, 9])  # hit block 0, then needs 3 more: only 2 left
    hits, n = bm.get_computed_blocks(b)
    assert hits == [0]
    assert not bm.allocate_slots(b, 5, hits)
    assert refs(bm) == [0, 0, 0]
    assert bm.num_free_blocks == 3


def test_chained_hash_distinguishes_equal_blocks_after_different_prefixes():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 0])
    assert bm.allocate_slots(a, 5)
    bm.cache_full_blocks(a, 5)
    b = make_request("b", [9, 9, 3, 4, 0])  # second block equal, first differs
    assert bm.get_computed_blocks(b) == ([], 0)


# ---- block keys: a cryptographic digest, salted per tenant ----------------------------------------


def blake2b_256(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def test_block_keys_are_pinned_blake2b_digests_of_the_parent_key_and_the_tokens():
    framed = b"".join(len(part).to_bytes(8, "little") + part for part in (b"tandem/prefix-cache/v1", b"", b""))
    assert root_key() == blake2b_256(framed)
    salted = b"".join(len(part).to_bytes(8, "little") + part
                      for part in (b"tandem/prefix-cache/v1", b"\x01tenant-a", b""))
    assert root_key("tenant-a") == blake2b_256(salted)
    assert root_key("") != root_key()  # an empty salt is still a salt

    first = hash_block(root_key(), [1, 2, 3, 4])
    assert first == blake2b_256(root_key() + struct.pack("=4I", 1, 2, 3, 4))
    assert hash_block(first, [5, 6, 7, 8]) == blake2b_256(first + struct.pack("=4I", 5, 6, 7, 8))
    assert len(first) == 32  # 256 bits

    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(1, 10)))
    bm._update_block_hashes(a, 2)
    assert a.block_hashes == [hash_block(root_key(), [1, 2, 3, 4]), hash_block(a.block_hashes[0], [5, 6, 7, 8])]


def test_cache_salt_keeps_tenants_apart_and_the_same_salt_shares():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 113))  # 3 full blocks and one token

    def cached_after(first_salt, second_salt) -> int:
        first = make_request("first", prompt, cache_salt=first_salt)
        assert bm.allocate_slots(first, len(prompt))
        first.num_computed_tokens = len(prompt)
        bm.cache_full_blocks(first, len(prompt))
        second = make_request("second", prompt, cache_salt=second_salt)
        _, num_hit_tokens = bm.get_computed_blocks(second)
        bm.free(first)
        bm.reset_prefix_cache()
        return num_hit_tokens

    assert cached_after("tenant-a", "tenant-b") == 0
    assert cached_after("tenant-a", None) == 0
    assert cached_after(None, "tenant-a") == 0
    assert cached_after("tenant-a", "tenant-a") == 12
    assert cached_after(None, None) == 12
