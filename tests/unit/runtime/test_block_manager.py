"""Block manager: exact block ids, prefix-cache hits, eviction order, all-or-nothing, no leaks."""

from __future__ import annotations

from kernellab.runtime.request.block_manager import BlockManager, slot_of
from kernellab.runtime.request.sampling import SamplingParams
from kernellab.runtime.request.sequence import Sequence

BS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(temperature=0.0), max_tokens=8)


def admit(bm: BlockManager, s: Sequence) -> bool:
    hits = bm.get_computed_blocks(s)
    return bm.allocate_slots(s, s.num_tokens - len(hits) * BS, hits)


def compute(bm: BlockManager, s: Sequence) -> None:
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(10)))  # 3 blocks
    assert admit(bm, a)
    assert a.block_table == [0, 1, 2]
    b = seq("b", list(range(100, 105)))  # 2 blocks
    assert admit(bm, b)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    bm.check_integrity([a, b])


def test_all_or_nothing():
    bm = BlockManager(3, BS)
    a = seq("a", list(range(9)))  # needs 3
    b = seq("b", list(range(50, 55)))  # needs 2
    assert admit(bm, a)
    assert not admit(bm, b)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 0
    bm.check_integrity([a, b])


def test_prefix_hit_shares_full_blocks_and_counts_tokens():
    bm = BlockManager(16, BS)
    shared = list(range(12))  # three full blocks
    a = seq("a", [*shared, 90, 91])
    assert admit(bm, a)
    compute(bm, a)
    b = seq("b", [*shared, 70])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:3]
    assert bm.allocate_slots(b, b.num_tokens - 12, hits)
    assert b.num_computed_tokens == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] not in a.block_table
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.prefix_hits == 12 and bm.prefix_queries == a.num_tokens + b.num_tokens
    bm.check_integrity([a, b])


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, BS)
    a = seq("a", list(range(8)))  # exactly two full blocks
    assert admit(bm, a)
    compute(bm, a)
    b = seq("b", list(range(8)))
    # Only the first block may hit: the second holds the last token, which must run to give logits.
    assert bm.get_computed_blocks(b) == [a.block_table[0]]


def test_freed_cached_blocks_are_reused_then_evicted_oldest_first():
    bm = BlockManager(4, BS)
    a = seq("a", list(range(9)))  # blocks 0, 1, 2 (2 is partial)
    assert admit(bm, a)
    compute(bm, a)
    bm.free_sequence(a)
    # Tail first: free queue is 3, 2, 1, 0 → allocation order.
    assert list(bm.free) == [3, 2, 1, 0]
    # A request with the same prefix revives blocks 0 and 1 from the cache.
    again = seq("again", list(range(9)))
    assert bm.get_computed_blocks(again) == [0, 1]
    bm.free_sequence(again)
    # An unrelated request of 3 blocks takes 3, 2, 1: block 1's cached hash is evicted, block 0 survives.
    other = seq("other", list(range(200, 210)))
    assert admit(bm, other)
    assert other.block_table == [3, 2, 1]
    assert bm.get_computed_blocks(seq("probe", list(range(9)))) == [0]
    bm.check_integrity([other])


def test_reset_prefix_cache_forgets_prefixes_only_when_idle():
    bm = BlockManager(4, BS)
    a = seq("a", list(range(9)))
    assert admit(bm, a)
    compute(bm, a)
    assert not bm.reset_prefix_cache()  # a is still running: nothing changes
    assert bm.cached and list(bm.free) == [3]
    bm.free_sequence(a)
    assert bm.get_computed_blocks(seq("probe", list(range(9)))) == [0, 1]
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(seq("probe", list(range(9)))) == []
    assert not bm.cached and list(bm.free) == [0, 1, 2, 3]  # allocation order as in a fresh pool
    again = seq("again", list(range(9)))
    assert admit(bm, again) and again.block_table == [0, 1, 2] and again.num_computed_tokens == 0
    bm.check_integrity([again])


def test_free_returns_every_block_and_integrity_detects_leaks():
    bm = BlockManager(6, BS)
    seqs = [seq(str(i), list(range(i * 10, i * 10 + 6))) for i in range(3)]
    for s in seqs:
        assert admit(bm, s)
    for s in seqs:
        bm.free_sequence(s)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0
    bm.check_integrity([])
    leaked = seq("leak", [1, 2, 3])
    assert admit(bm, leaked)
    try:
        bm.check_integrity([])
    except AssertionError as exc:
        assert "live references" in str(exc)
    else:
        raise AssertionError("a block held by no live sequence must fail the integrity check")


def test_identical_blocks_computed_twice_keep_one_cache_entry():
    bm = BlockManager(8, BS)
    a, b = seq("a", list(range(5))), seq("b", list(range(5)))
    assert admit(bm, a) and admit(bm, b)  # admitted together: b could not hit a yet
    compute(bm, a)
    compute(bm, b)
    assert bm.cached[bm.blocks[a.block_table[0]].hash] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    bm.free_sequence(a)
    bm.free_sequence(b)
    bm.check_integrity([])


def test_slot_of_maps_positions_through_the_block_table():
    """One formula for the runner's per-token slots and the decode window's vectorized ones."""
    import numpy as np

    tables = [[7, 2, 9], [4, 0, 5]]
    bs = 4
    assert [slot_of(tables[0], p, bs) for p in (0, 3, 4, 9)] == [28, 31, 8, 37]
    pos = np.array([[1, 6], [2, 9]])  # (steps, rows): row 0's positions 1, 2 and row 1's 6, 9
    got = slot_of(np.array(tables, dtype=np.int32), pos, bs, rows=np.arange(2)[None, :])
    want = [[slot_of(tables[r], int(pos[k, r]), bs) for r in range(2)] for k in range(2)]
    assert got.tolist() == want == [[29, 2], [30, 21]]


def test_a_sequences_block_hashes_are_computed_once_and_survive_preemption():
    """The prefix lookup and the registration after the prefill share one hash chain per sequence (it is a function
    of the tokens alone): the registration extends it by the blocks the lookup did not reach, a preempted sequence
    keeps it, and what is registered is the chain a fresh computation gives."""
    from kernellab.runtime.request.block_manager import block_bytes, chain_hash

    bm = BlockManager(16, BS)
    a = seq("a", list(range(13)))  # 3 full blocks and one token
    assert admit(bm, a)
    assert len(a.hash_chain) == 1  # the lookup stopped at its first miss (a fresh pool): one block hashed
    first = list(a.hash_chain)
    compute(bm, a)
    assert len(a.hash_chain) == 3 and a.hash_chain[0] is first[0]  # the registration extended it, recomputed none
    expected, prev = [], None
    for i in range(3):
        prev = chain_hash(prev, block_bytes(range(i * BS, (i + 1) * BS)))
        expected.append(prev)
    assert a.block_hashes == expected and a.hash_chain == expected
    a.token_ids.extend([13, 14, 15])  # decoding fills the fourth block
    a.num_computed_tokens = 16
    bm.cache_full_blocks(a)
    assert len(a.hash_chain) == 4 and a.block_hashes == a.hash_chain
    bm.free_sequence(a)  # preempted: its blocks go, its chain stays
    assert a.block_hashes == [] and len(a.hash_chain) == 4
    a.num_computed_tokens = 0
    hits = bm.get_computed_blocks(a)
    assert len(hits) == 3 and len(a.hash_chain) == 4  # its freed blocks still hold its prefix
    bm.check_integrity([])


def test_the_lookup_hashes_as_far_as_the_cached_prefix_goes_and_finds_all_of_it():
    """The lookup's hash chain grows in doubling runs: a long cached prefix is found whole (every block), a fresh
    prompt's lookup hashes only its first block, and blocks registered ahead (a launched step's, ``upto``) are hits
    for the next request."""
    bm = BlockManager(64, BS)
    a = seq("a", list(range(4 * 37 + 2)))  # 37 full blocks and two tokens
    assert admit(bm, a)
    assert len(a.hash_chain) == 1
    bm.cache_full_blocks(a, upto=a.num_tokens)  # what the engine does once the prefill is launched
    assert len(a.block_hashes) == 37 and a.num_computed_tokens == 0
    compute(bm, a)  # the step's tokens read: nothing left to register
    assert len(a.block_hashes) == 37
    b = seq("b", [*range(4 * 37 + 2), 999])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:37] and len(b.hash_chain) == 37
    c = seq("c", [*range(4 * 20), *[7] * 40])  # shares 20 blocks, then differs
    hits = bm.get_computed_blocks(c)
    assert hits == a.block_table[:20] and 21 <= len(c.hash_chain) <= 2 * 21
    bm.check_integrity([a])


def test_block_keys_hold_no_container_for_the_garbage_collector_to_walk():
    """A block's tokens are keyed as int64 bytes, not a tuple of ints: nothing the prefix cache keeps per block is
    tracked by Python's cyclic collector (a burst's tuples made the worker's young collections take 1-2 ms), and
    a prompt hashed from the request check's int64 array keys its blocks exactly as one hashed from its list."""
    import gc

    import numpy as np

    bm = BlockManager(32, BS)
    ids = [5, 70_000, 3, 151_935, 0, 9, 9, 1, 2, 2, 4]  # two full blocks and three tokens
    a = Sequence("a", ids, SamplingParams(temperature=0.0), 8, token_array=np.asarray(ids, dtype=np.int64))
    assert admit(bm, a)
    compute(bm, a)
    b = seq("b", list(ids))  # no array: hashed from the list
    assert bm.get_computed_blocks(b) == a.block_table[:2] and b.hash_chain == a.hash_chain
    registered = [bm.blocks[i] for i in a.block_table[:2]]
    assert [blk.hash for blk in registered] == a.block_hashes
    assert registered[1].token_ids == np.asarray(ids[BS : 2 * BS], dtype=np.int64).tobytes()
    assert not any(gc.is_tracked(blk.token_ids) for blk in registered)
    assert not gc.is_tracked(a.chain_bytes)
    c = seq("c", [5, 70_000, 3, 151_935, 0, 9, 9, 2, 7])  # the second block differs in its last token
    assert bm.get_computed_blocks(c) == a.block_table[:1]


def test_a_sequences_ids_are_no_container_for_the_collector_either():
    import gc

    s = seq("s", list(range(40)))
    s.token_ids.append(7)
    s.token_ids.extend([8, 9])
    # the collector walks a C array as one object (at most its type), not id by id as it walks a list
    assert len(gc.get_referents(s.token_ids)) <= 1 and s.num_tokens == 43
    assert s.token_ids[40:].tolist() == s.output_token_ids == [7, 8, 9] and type(s.token_ids[3]) is int


def test_a_sequence_takes_its_ids_from_the_wire_the_check_or_a_list_alike():
    import numpy as np

    from kernellab.runtime.request.sampling import SamplingParams
    from kernellab.runtime.request.token_ids import pack_token_ids, unpack_token_ids

    prompt, out = [3, 151_935, 0, 2**31 + 5], [9, 8]
    wire = Sequence("w", unpack_token_ids(pack_token_ids(prompt)), SamplingParams(), 4, output_token_ids=out)
    checked = Sequence("c", prompt, SamplingParams(), 4, output_token_ids=out, token_array=np.array(prompt + out))
    plain = Sequence("p", prompt, SamplingParams(), 4, output_token_ids=tuple(out))
    for s in (wire, checked, plain):
        assert s.token_ids.typecode == "q" and s.token_ids.tolist() == prompt + out
        assert s.num_prompt_tokens == 4 and s.output_token_ids == out
