"""Paged KV-cache block pool with reference counts and prefix caching (no torch).

Blocks are ids into the cache tensors. A *full* block whose K/V has been computed is registered under the
hash of its tokens chained with the previous block's hash, so two sequences that share a prefix share its
blocks. Freed blocks go to the back of the free queue but keep their hash; allocation takes from the front,
so the least recently freed cached block is evicted first, and a later request can still hit a freed block
until then. Allocation is all-or-nothing.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kernellab.runtime.request.sequence import Sequence

TOKEN_BYTES = 8  # a block's tokens are keyed as their int64 bytes


def chain_hash(prev: int | None, tokens: bytes) -> int:
    """The chain hash of a block: its tokens' int64 bytes (``block_bytes``) hashed with the previous block's."""
    return hash((prev, tokens))


def block_bytes(token_ids) -> bytes:
    """Token ids as the int64 bytes a block is keyed by. Bytes, not a tuple of ints: a bytes object is not a
    container, so Python's cyclic garbage collector never tracks it, while each tuple of a block's ids (two a
    block, with the chain's pair) was a young container the next collection walked id by id: a burst of 64
    prompts of 512 tokens left ~4,000 of them, ~60,000 references, and the worker's generation-0 collections in
    its first steps took 1-2 ms on an H100 (``KERNELLAB_GC_PROBE_MS``'s census, docs/deploy.md)."""
    return array("q", token_ids).tobytes()


def slot_of(block_table, pos, block_size: int, rows=None):
    """The KV cache slot of token position ``pos``: physical block ``block_table[pos // block_size]`` at offset
    ``pos % block_size``, flattened as ``block * block_size + offset`` (the row of the ``(num_blocks *
    block_size, heads, head_dim)`` cache view the kernels write). With a 2-D table (one row per sequence) and
    an array of positions, ``rows`` gives each position's sequence row (numpy broadcasting)."""
    block = block_table[pos // block_size] if rows is None else block_table[rows, pos // block_size]
    return block * block_size + pos % block_size


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: bytes = b""  # the tokens of a registered (hashed) block, int64 bytes (block_bytes)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion-ordered set of free block ids: front = evicted first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # hash → block id
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def hash_chain(self, seq: Sequence, n: int) -> list[int]:
        """The chain hashes of ``seq``'s first ``n`` full blocks (and any computed before), each computed once per
        sequence: a 2,048-token prompt's 128 blocks took ~0.1 ms to hash on the CPU, once for the lookup and again
        when the prefill registered them, both inside its time to first token. The blocks' tokens, as int64 bytes,
        grow beside them in ``seq.chain_bytes`` (``block_tokens``)."""
        chain, bs = seq.hash_chain, self.block_size
        start = len(chain)
        if start < n:
            new = seq.token_ids[start * bs : n * bs].tobytes()  # int64 already (Sequence.token_ids): block_bytes
            w = bs * TOKEN_BYTES
            prev = chain[-1] if chain else None
            for off in range(0, len(new), w):
                prev = chain_hash(prev, new[off : off + w])
                chain.append(prev)
            seq.chain_bytes += new
        return chain

    def block_tokens(self, seq: Sequence, i: int) -> bytes:
        """Block ``i``'s tokens as int64 bytes (``hash_chain`` has reached it)."""
        w = self.block_size * TOKEN_BYTES
        return bytes(seq.chain_bytes[i * w : (i + 1) * w])

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of a fresh sequence's tokens (no side effects but the sequence's hash
        chain). Only blocks strictly before the last token: that token must be computed to produce logits. None
        for a sequence that wants its prompt logprobs: every prompt position's logits are computed."""
        hits: list[int] = []
        if not self.enable_prefix_caching or seq.block_table or seq.wants_prompt_logprobs:
            return hits
        n = (seq.num_tokens - 1) // self.block_size
        # The chain grows in doubling runs as far as the lookup gets: a fresh prompt hashes its first block here
        # and the rest once its prefill is launched (``cache_full_blocks(seq, upto)``, while the device computes),
        # not all of them before the device can start.
        chain, want = seq.hash_chain, 1
        for i in range(n):
            if i >= len(chain):
                self.hash_chain(seq, min(n, i + want))
                want *= 2
            block_id = self.cached.get(chain[i])
            if block_id is None or self.blocks[block_id].token_ids != self.block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | tuple[int, ...] = ()
    ) -> bool:
        """Make the block table cover ``num_computed + cached + num_new`` tokens, first taking the cached
        prefix blocks of a fresh sequence (which advances ``num_computed_tokens``).
        All-or-nothing: on False nothing changed."""
        bs = self.block_size
        target = seq.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        need = self.blocks_needed(target) - len(seq.block_table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if need + revived > len(self.free):
            return False
        if not seq.block_table and seq.num_computed_tokens == 0:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(computed_blocks) * bs
        for block_id in computed_blocks:
            self._ref(block_id)
        seq.block_table.extend(computed_blocks)
        seq.num_computed_tokens += len(computed_blocks) * bs
        if need > 0:
            seq.block_table.extend(self._take_free_n(need))
        return True

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free_n(self, n: int) -> list[int]:
        """The ``n`` blocks at the front of the free queue, referenced once; a cached one leaves the hash index
        (the oldest cached block is evicted first)."""
        free, blocks, cached = self.free, self.blocks, self.cached
        taken = []
        for _ in range(n):
            block_id, _ = free.popitem(last=False)
            block = blocks[block_id]
            h = block.hash
            if h is not None:
                if cached.get(h) == block_id:
                    del cached[h]
                block.hash, block.token_ids = None, b""
            block.ref_count = 1
            taken.append(block_id)
        return taken

    def free_sequence(self, seq: Sequence) -> None:
        """Release a sequence's blocks now; tail blocks are freed first so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def cache_full_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Register blocks that are full and computed, so later requests can share them. ``upto``: the tokens whose
        KV is computed or being computed by a step already launched on the device (default: the computed ones).
        Registering a launched step's blocks before its results are read is safe: a request that hits them is
        scheduled after that read, and its step runs after this one on the device's stream; the engine does so
        while the device computes (``LLMEngine.step``), so the hashing is not in the time to first token."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.block_hashes
        n = (seq.num_computed_tokens if upto is None else upto) // self.block_size
        if len(hashes) >= n:
            return
        chain = self.hash_chain(seq, n)
        blocks, cached, table = self.blocks, self.cached, seq.block_table
        for i in range(len(hashes), n):
            h = chain[i]
            hashes.append(h)
            block = blocks[table[i]]
            if block.hash is not None or h in cached:
                continue  # already registered (a prefix hit), or an identical block exists: keep this one private
            block.hash, block.token_ids = h, self.block_tokens(seq, i)
            cached[h] = block.block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix and put the free queue back in block order, as a fresh pool: what a
        benchmark needs between runs of the same prompts (otherwise later runs skip their prefill). Only an idle
        pool can be reset: with a block in use, nothing changes and the answer is False."""
        if len(self.free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash, block.token_ids = None, b""
        self.cached.clear()
        self.free = OrderedDict.fromkeys(range(self.num_blocks))
        return True

    # ------------------------------------------------------------------ checks
    def check_integrity(self, live: list[Sequence] | None = None) -> None:
        """Raise if reference counts, the free queue or the hash index disagree (and, given the live
        sequences, if any block is referenced by none of them: a leak)."""
        refs = [0] * self.num_blocks
        for seq in live or []:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            in_free = block.block_id in self.free
            if block.ref_count < 0 or (block.ref_count == 0) != in_free:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count}, free={in_free}")
            if live is not None and refs[block.block_id] != block.ref_count:
                raise AssertionError(
                    f"block {block.block_id}: ref_count {block.ref_count} but {refs[block.block_id]} live references"
                )
        for h, block_id in self.cached.items():
            if self.blocks[block_id].hash != h:
                raise AssertionError(f"hash index points to block {block_id} whose hash differs")
