"""The planner's one entry point: the cheapest valid plan for one transfer (push WRITE or pull READ).

Three paths, tried in order (one run of consecutive blocks on both sides first, without per-block arrays,
`blockplan.plan_one_run`): whole-block runs merged into few descriptors (`blockplan.merge_runs`),
prepped per-block indices (`blockplan.plan_blocks`, when per-peer prepped lists exist), and the
general token-range planner (`planner.plan_transfer`) for every other pairing.
"""

from __future__ import annotations

from kvpush_common.plan.blockplan import MERGED_MAX_DESCS, BlockPlan, block_granular, merge_runs, plan_blocks, plan_one_run
from kvpush_common.plan.planner import TransferPlan, plan_transfer
from kvpush_common.protocol.layout import KVLayout
from kvpush_common.protocol.topology import HeadRoute


def plan_write(src: KVLayout, dst: KVLayout, route: HeadRoute, src_blocks, dst_blocks, *, num_tokens: int,
               dst_first_token: int = 0, prepped: bool = False) -> BlockPlan | TransferPlan:
    """The cheapest valid plan for one transfer: block runs merged into few descriptors when the blocks
    mostly line up; else prepped per-block indices when `prepped` lists exist; else the general planner."""
    if block_granular(src, dst, route):
        one = plan_one_run(src, dst, route, src_blocks, dst_blocks, num_tokens=num_tokens,
                           dst_first_token=dst_first_token, max_descs=MERGED_MAX_DESCS if prepped else None)
        if one is not None:  # one run of consecutive blocks on both sides: no per-block arrays
            return one
        bp = plan_blocks(src, dst, route, src_blocks, dst_blocks, num_tokens=num_tokens,
                         dst_first_token=dst_first_token)
        merged = merge_runs(src, dst, route, bp, MERGED_MAX_DESCS if prepped else None)
        if merged is not None:
            return merged
        if prepped:
            return bp
    return plan_transfer(src, dst, route, src_blocks, dst_blocks, num_tokens=num_tokens,
                         dst_first_token=dst_first_token)
