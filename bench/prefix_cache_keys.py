"""The cost of keying prefix-cache blocks: the BLAKE2b-256 chain against Python's 64-bit tuple hash.

    python bench/prefix_cache_keys.py [--block-size 16] [--blocks 20000]

Prints a table: nanoseconds per block and per token for each key function, over the same chain
of random blocks, and the share of one model step that keying a 2,048-token batch takes.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.core.block_manager import hash_block, root_key  # noqa: E402


def python_hash_chain(blocks: list[list[int]]) -> None:
    parent = None
    for block in blocks:
        parent = hash((parent, tuple(block)))  # the key Tandem used before (forgeable, 64 bits)


def blake2b_chain(blocks: list[list[int]]) -> None:
    parent = root_key()
    for block in blocks:
        parent = hash_block(parent, block)


def sha256_chain(blocks: list[list[int]]) -> None:
    from array import array

    parent = root_key()
    for block in blocks:
        parent = hashlib.sha256(parent + array("I", block).tobytes()).digest()


def best_of(fn, blocks, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(blocks)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    blocks = [[rng.randrange(49152) for _ in range(args.block_size)] for _ in range(args.blocks)]
    print(f"{args.blocks} blocks of {args.block_size} tokens, best of {args.repeats}")
    print(f"{'key':<34} {'ns/block':>9} {'ns/token':>9} {'us per 2048-token step':>23}")
    for name, fn in (("python hash((parent, tuple))", python_hash_chain),
                     ("blake2b-256 (Tandem's key)", blake2b_chain),
                     ("sha256", sha256_chain)):
        per_block = best_of(fn, blocks, args.repeats) / args.blocks
        per_token = per_block / args.block_size
        print(f"{name:<34} {per_block * 1e9:>9.0f} {per_token * 1e9:>9.0f} {per_token * 2048 * 1e6:>23.0f}")


if __name__ == "__main__":
    main()
