
import pytest

from kvpush_common.protocol.topology import (
    HeadRoute,
    TopologyError,
    local_heads,
    producers_for,
    routes,
    routes_from,
)

KS = (1, 2, 4, 8)
TPS = (1, 2, 4, 8, 16)
CASES = [(k, s, d) for k in KS for s in TPS for d in TPS]


def _valid(k, tp):
    return (tp <= k and k % tp == 0) or (tp > k and tp % k == 0)


def test_local_heads_examples():
    assert local_heads(8, 1, 0) == (0, 8)
    assert local_heads(8, 2, 1) == (4, 4)
    assert local_heads(8, 8, 5) == (5, 1)
    assert local_heads(8, 16, 5) == (2, 1)
    assert local_heads(8, 16, 15) == (7, 1)
    assert local_heads(1, 4, 3) == (0, 1)
    assert local_heads(2, 8, 3) == (0, 1)
    assert local_heads(2, 8, 4) == (1, 1)


@pytest.mark.parametrize("k,tp", [(k, tp) for k in KS for tp in TPS])
def test_local_heads_partition(k, tp):
    held = [local_heads(k, tp, r) for r in range(tp)]
    copies = {}
    for first, n in held:
        assert n >= 1 and 0 <= first and first + n <= k
        for g in range(first, first + n):
            copies[g] = copies.get(g, 0) + 1
    assert sorted(copies) == list(range(k))
    assert set(copies.values()) == {max(1, tp // k)}


@pytest.mark.parametrize(
    "k,tp", [(8, 3), (8, 5), (8, 6), (8, 12), (4, 3), (4, 6), (2, 3), (6, 4), (6, 9), (3, 2), (8, 0), (0, 2), (-4, 2)]
)
def test_local_heads_bad_split(k, tp):
    with pytest.raises(TopologyError) as ei:
        local_heads(k, tp, 0)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(TopologyError):
        routes(k, tp, 1)
    with pytest.raises(TopologyError):
        routes(k, 1, tp)
    with pytest.raises(TopologyError):
        producers_for(k, tp, 1, 0)


def test_error_messages():
    with pytest.raises(TopologyError, match=r"8 .*TP 3|TP 3.*8"):
        local_heads(8, 3, 0)
    with pytest.raises(TopologyError, match="out of range"):
        local_heads(8, 2, 2)
    with pytest.raises(TopologyError, match="out of range"):
        local_heads(8, 2, -1)
    with pytest.raises(TopologyError):
        local_heads(8, 2, 1.0)
    with pytest.raises(TopologyError, match="dst_rank"):
        producers_for(8, 2, 4, 4)
    with pytest.raises(TopologyError, match="src_rank"):
        routes_from(8, 2, 4, 2)


@pytest.mark.parametrize("k,src_tp,dst_tp", CASES)
def test_routes_cover_every_dst_head_once(k, src_tp, dst_tp):
    rs = routes(k, src_tp, dst_tp)
    assert rs == sorted(rs, key=lambda r: (r.src_rank, r.dst_rank))
    assert all(isinstance(r, HeadRoute) for r in rs)
    written = {}  # (dst_rank, dst local head) -> global head written there
    for r in rs:
        assert r.num_heads >= 1
        s_first, s_n = local_heads(k, src_tp, r.src_rank)
        d_first, d_n = local_heads(k, dst_tp, r.dst_rank)
        assert 0 <= r.src_head_start and r.src_head_start + r.num_heads <= s_n
        assert 0 <= r.dst_head_start and r.dst_head_start + r.num_heads <= d_n
        for j in range(r.num_heads):
            g_src = s_first + r.src_head_start + j  # the src rank really holds this head
            g_dst = d_first + r.dst_head_start + j
            assert g_src == g_dst
            key = (r.dst_rank, r.dst_head_start + j)
            assert key not in written, f"dst head {key} written twice"
            written[key] = g_dst
    expected = {}
    for d in range(dst_tp):
        first, n = local_heads(k, dst_tp, d)
        for j in range(n):
            expected[(d, j)] = first + j
    assert written == expected


@pytest.mark.parametrize("k,src_tp,dst_tp", CASES)
def test_routes_are_merged(k, src_tp, dst_tp):
    rs = routes(k, src_tp, dst_tp)
    # with contiguous head ownership, each (src, dst) pair is a single route
    pairs = [(r.src_rank, r.dst_rank) for r in rs]
    assert len(pairs) == len(set(pairs))
    # number of routes into a dst rank: how many src ranks its heads span
    for d in range(dst_tp):
        first, n = local_heads(k, dst_tp, d)
        per_src = max(1, k // src_tp)
        expect = len({g // per_src for g in range(first, first + n)}) if src_tp <= k else n
        assert len([r for r in rs if r.dst_rank == d]) == expect


@pytest.mark.parametrize("k,src_tp,dst_tp", CASES)
def test_routes_read_a_holder_of_their_heads_and_spread_replicas(k, src_tp, dst_tp):
    """Each route reads its first head from a producer rank that holds it: the only one when producers split
    the heads, replica `dst_rank % replicas` when they replicate them (so decode ranks spread the load)."""
    rs = routes(k, src_tp, dst_tp)
    for r in rs:
        d_first, _ = local_heads(k, dst_tp, r.dst_rank)
        g = d_first + r.dst_head_start
        holders = [s for s in range(src_tp)
                   if local_heads(k, src_tp, s)[0] <= g < sum(local_heads(k, src_tp, s))]
        if src_tp <= k:
            assert holders == [r.src_rank]
        else:
            assert r.src_rank == holders[r.dst_rank % (src_tp // k)]


@pytest.mark.parametrize("k,src_tp,dst_tp", CASES)
def test_producers_for_and_routes_from(k, src_tp, dst_tp):
    rs = routes(k, src_tp, dst_tp)
    for d in range(dst_tp):
        assert producers_for(k, src_tp, dst_tp, d) == sorted({r.src_rank for r in rs if r.dst_rank == d})
    gathered = []
    for s in range(src_tp):
        mine = routes_from(k, src_tp, dst_tp, s)
        assert all(r.src_rank == s for r in mine)
        assert mine == sorted(mine, key=lambda r: r.dst_rank)
        gathered += mine
    assert gathered == rs


def test_specific_routes():
    # TP4 -> TP2 with 8 heads: dst 0 gets src 0 and 1
    assert routes(8, 4, 2) == [
        HeadRoute(0, 0, 0, 0, 2),
        HeadRoute(1, 0, 0, 2, 2),
        HeadRoute(2, 1, 0, 0, 2),
        HeadRoute(3, 1, 0, 2, 2),
    ]
    # TP2 -> TP4: src 0 splits its 4 heads into dst 0 and 1
    assert routes(8, 2, 4) == [
        HeadRoute(0, 0, 0, 0, 2),
        HeadRoute(0, 1, 2, 0, 2),
        HeadRoute(1, 2, 0, 0, 2),
        HeadRoute(1, 3, 2, 0, 2),
    ]
    # 2 heads, src TP8 (4 replicas each) -> dst TP1: replica 0 of each head
    assert routes(2, 8, 1) == [HeadRoute(0, 0, 0, 0, 1), HeadRoute(4, 0, 0, 1, 1)]
    # 2 heads, src TP8 -> dst TP4: dst d reads replica d % 4
    assert routes(2, 8, 4) == [
        HeadRoute(0, 0, 0, 0, 1),
        HeadRoute(1, 1, 0, 0, 1),
        HeadRoute(6, 2, 0, 0, 1),
        HeadRoute(7, 3, 0, 0, 1),
    ]
    assert producers_for(2, 8, 1, 0) == [0, 4]
    assert routes_from(2, 8, 1, 1) == []


def test_all_cases_valid():
    assert all(_valid(k, s) and _valid(k, d) for k, s, d in CASES)
