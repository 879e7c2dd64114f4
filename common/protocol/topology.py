"""Tensor-parallel KV-head routing between a producer (src) and a consumer (dst).

A model has `K` KV heads.  With `tp` ranks, either each rank holds `K // tp` consecutive heads
(tp <= K), or each head is replicated on `tp // K` consecutive ranks and each rank holds exactly one
head (tp > K).  `routes` says, for every head a consumer rank holds, which producer rank writes it,
as a few `HeadRoute`s of consecutive heads.  Head starts in a route are LOCAL indices, i.e. offsets
within the heads the rank holds (what `KVLayout.num_heads` counts).

Pure integer math, standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TopologyError", "HeadRoute", "local_heads", "routes", "producers_for", "routes_from"]


class TopologyError(ValueError):
    """The head count and TP sizes cannot be split evenly, or a rank is out of range."""


def _check_split(total_kv_heads: int, tp_size: int) -> None:
    for name, value in (("total_kv_heads", total_kv_heads), ("tp_size", tp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TopologyError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise TopologyError(f"{name} must be >= 1, got {value}")
    if tp_size <= total_kv_heads:
        if total_kv_heads % tp_size:
            raise TopologyError(
                f"cannot split {total_kv_heads} KV heads over TP {tp_size}: "
                f"{total_kv_heads} is not a multiple of {tp_size}"
            )
    elif tp_size % total_kv_heads:
        raise TopologyError(
            f"cannot replicate {total_kv_heads} KV heads over TP {tp_size}: "
            f"{tp_size} is not a multiple of {total_kv_heads}"
        )


def _check_rank(tp_size: int, rank: int, what: str = "rank") -> None:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TopologyError(f"{what} must be an int, got {rank!r}")
    if not 0 <= rank < tp_size:
        raise TopologyError(f"{what} {rank} out of range for TP {tp_size} (0..{tp_size - 1})")


def local_heads(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first global head, number of heads) held by `rank` of a TP group of `tp_size`."""
    _check_split(total_kv_heads, tp_size)
    _check_rank(tp_size, rank)
    if tp_size <= total_kv_heads:
        per_rank = total_kv_heads // tp_size
        return rank * per_rank, per_rank
    return rank // (tp_size // total_kv_heads), 1


@dataclass(frozen=True)
class HeadRoute:
    """`num_heads` consecutive heads go from src rank local head `src_head_start` on to dst rank
    local head `dst_head_start` on."""

    src_rank: int
    dst_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


def _src_for_head(total_kv_heads: int, src_tp: int, head: int, dst_rank: int) -> tuple[int, int]:
    """(src rank, local head index) that writes global `head` into `dst_rank`."""
    if src_tp <= total_kv_heads:
        per_rank = total_kv_heads // src_tp
        return head // per_rank, head % per_rank
    replicas = src_tp // total_kv_heads
    return head * replicas + dst_rank % replicas, 0


def _routes_into(total_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadRoute]:
    first, count = local_heads(total_kv_heads, dst_tp, dst_rank)
    out: list[HeadRoute] = []
    for j in range(count):
        src_rank, src_local = _src_for_head(total_kv_heads, src_tp, first + j, dst_rank)
        if out:
            last = out[-1]
            if (
                last.src_rank == src_rank
                and last.src_head_start + last.num_heads == src_local
                and last.dst_head_start + last.num_heads == j
            ):
                out[-1] = HeadRoute(src_rank, dst_rank, last.src_head_start, last.dst_head_start, last.num_heads + 1)
                continue
        out.append(HeadRoute(src_rank, dst_rank, src_local, j, 1))
    return out


def _sort_key(r: HeadRoute) -> tuple[int, int, int]:
    return (r.src_rank, r.dst_rank, r.dst_head_start)


def routes(total_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every route between the two TP groups, sorted by (src_rank, dst_rank).

    Each head held by each dst rank is written by exactly one src rank; where the producer holds
    a head on several ranks (src_tp > K), dst rank d reads it from replica `d % (src_tp // K)`.
    """
    _check_split(total_kv_heads, src_tp)
    _check_split(total_kv_heads, dst_tp)
    out: list[HeadRoute] = []
    for dst_rank in range(dst_tp):
        out += _routes_into(total_kv_heads, src_tp, dst_tp, dst_rank)
    return sorted(out, key=_sort_key)


def producers_for(total_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Sorted src ranks that write into `dst_rank`."""
    _check_split(total_kv_heads, src_tp)
    _check_split(total_kv_heads, dst_tp)
    _check_rank(dst_tp, dst_rank, "dst_rank")
    return sorted({r.src_rank for r in _routes_into(total_kv_heads, src_tp, dst_tp, dst_rank)})


def routes_from(total_kv_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> list[HeadRoute]:
    """The routes `src_rank` writes, sorted by dst_rank (may be empty when src replicates heads)."""
    _check_split(total_kv_heads, src_tp)
    _check_rank(src_tp, src_rank, "src_rank")
    return [r for r in routes(total_kv_heads, src_tp, dst_tp) if r.src_rank == src_rank]
