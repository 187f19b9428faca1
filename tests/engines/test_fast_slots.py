"""The fast engine's slot table (turnrl/engines/fast/slots.py): placement, reuse, deferral and eviction rules,
host side only."""

from turnrl.engines.fast.slots import Plan, SlotTable

A = list(range(100, 140))
B = list(range(500, 540))


def admit(table, *prompts, reuse=True):
    plans = [table.plan(p) for p in prompts]
    committed = table.commit(reuse)
    assert committed == [p for p in plans if p is not None]
    return plans


def test_placement_reuse_copy_deferral_and_release():
    table = SlotTable(4)
    assert admit(table, A, A + [1], B) == [Plan(0, 0), None, Plan(1, 0)]   # A + [1] waits for A's prefill
    assert admit(table, A + [1]) == [Plan(2, 40, source=0)]               # then copies the KV of all of A
    table.finished(0, A + [7, 8])
    assert list(table.parked) == [0] and 0 not in table.running
    assert admit(table, A + [7, 8, 9]) == [Plan(0, 42)]                     # a later turn continues in place
    table.finished(2, None)                                                # aborted: freed, not parked
    assert table.empty == [2, 3] and table.stats["parked_reuses"] == 1 and table.stats["prefix_copies"] == 1


def test_short_prompts_and_a_disabled_table_never_share():
    table = SlotTable(3, min_match=16)
    assert admit(table, A[:10], A[:10]) == [Plan(0, 0), Plan(1, 0)]
    off = SlotTable(3, enabled=False)
    assert admit(off, A, A) == [Plan(0, 0), Plan(1, 0)]
    off.finished(0, A)
    assert not off.parked and off.empty == [0, 2]


def test_eviction_is_least_recently_used_and_spares_this_admissions_sources():
    table = SlotTable(2)
    admit(table, A, B)
    table.finished(0, A)
    table.finished(1, B)
    assert table.available() == 2
    # B + ... copies nothing (B is parked: it continues in slot 1); the next prompt evicts A's slot 0
    assert admit(table, B + [1], list(range(900, 940))) == [Plan(1, 40), Plan(0, 0)]
    assert table.stats["evicted"] == 1 and table.available() == 0 and table.plan(A) is None


def test_new_weights_make_everything_cached_unusable():
    table = SlotTable(3)
    admit(table, A, B)
    table.finished(0, A)
    assert table.plan(A + [1]) == Plan(0, 40)
    table.drop_cached()                    # a weight update while that admission was being formed
    assert table.commit(reuse=False) == [Plan(0, 0)]
    table.finished(1, B)                   # B ran under the old weights: freed, not parked
    assert not table.parked and 1 in table.empty
    table.finished(0, A + [1, 2])          # admitted after the update: parked
    assert list(table.parked) == [0]


def test_cancel_gives_the_slots_back():
    table = SlotTable(2)
    table.plan(A)
    table.plan(B)
    assert table.available() == 0
    table.cancel()
    assert table.empty == [0, 1] and table.available() == 2


def test_a_request_waits_once_and_matches_go_through_the_block_index():
    table = SlotTable(4)
    assert table.plan(A) == Plan(0, 0)
    assert table.plan(A + [1]) is None and table.plan(A + [1], may_wait=False) == Plan(1, 0)
    table.commit()
    assert set(table._index) and all(holders == {0, 1} for holders in table._index.values())   # 2 blocks each
    assert table.plan(A[:33] + [5, 6]) == Plan(2, 33, source=0)       # the deepest common block, then exact
    table.commit()
    table.finished(0, None)
    table.finished(1, None)
    table.finished(2, None)
    assert not table._index and table.empty == [0, 1, 2, 3]


def test_a_later_turn_parked_high_moves_down_to_the_lowest_empty_slot():
    table = SlotTable(4)
    admit(table, B, list(range(900, 940)), A)
    table.finished(0, None)
    table.finished(1, None)
    table.finished(2, A + [7])
    assert admit(table, A + [7, 8]) == [Plan(0, 41, source=2)]      # copied down; decode batches stay small
    assert table.empty == [1, 2, 3] and not table.parked and list(table.running) == [0]


def test_match_reads_what_a_plan_would_reuse_and_changes_nothing():
    table = SlotTable(4)
    admit(table, A)
    table.finished(0, A + [7, 8])
    state = (list(table.empty), dict(table.parked), dict(table.stats), {h: set(s) for h, s in table._index.items()})
    found = table.match(A + [7, 8, 9])
    assert (found.slot, found.length) == (0, 42)
    assert table.match(B).slot is None and table.match(B).length == 0
    assert (list(table.empty), dict(table.parked), dict(table.stats),
            {h: set(s) for h, s in table._index.items()}) == state
    assert table.plan(A + [7, 8, 9], found=found) == Plan(0, 42)             # the plan it announced
    table.commit()
