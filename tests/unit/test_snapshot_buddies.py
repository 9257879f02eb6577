"""Who holds the copy of each rank's snapshot shard ([Note: buddy copies] in
zeroray/runtime/snapshot.py): the next rank on another node, none on a single node."""
from zeroray.runtime.worker_group.group import buddies


def test_buddy_is_the_next_rank_on_another_node():
    assert buddies(["a", "b"]) == [1, 0]
    assert buddies(["a", "a", "b", "b"]) == [2, 2, 0, 0]
    assert buddies(["a", "b", "c"]) == [1, 2, 0]
    assert buddies(["a", "a", "b"]) == [2, 2, 0]


def test_no_buddy_on_one_node():
    assert buddies(["a"]) == [None]
    assert buddies(["a", "a", "a"]) == [None, None, None]
    assert buddies([]) == []
