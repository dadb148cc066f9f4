r"""Random-block-k: a uniformly random *set* of fixed-size blocks per unit, ``k`` entries in all.

Eghlidi & Jaggi (2020, arXiv 2009.09271) divide the gradient into blocks of
a fixed size and send a randomly selected set of blocks at each step. For a
unit of ``n`` entries with budget ``k`` and block size ``b``:

1. **Phase.** The unit is read as a ring turned by a phase ``r``, uniform
   in ``[0, n)``: rotated position ``y`` is unit position ``(r + y) mod n``.
2. **Blocks.** The rotated unit is cut into ``B = ceil(n / b)`` aligned
   blocks ``[j b, min((j + 1) b, n))``; only the last may be shorter.
3. **Set.** ``min(ceil(k / b) + 1, B)`` distinct blocks are drawn, every
   subset equally likely, in a random order
   (:func:`~.draws.random_subsets` over block indices).
4. **Trim.** The blocks are taken in draw order until ``k`` entries are
   reached: all but the last one taken are whole, the last is cut to its
   first entries. One block more than ``ceil(k / b)`` is drawn so that a
   short last block among them can never leave the budget unfilled.

So each step sends exactly ``k`` entries in at most ``ceil(k / b) + 1``
contiguous runs (one more where a run crosses the end of the unit). Every
coordinate is sent with probability exactly ``k / n``: for any fixed set of
``k`` rotated positions, a uniform phase carries each coordinate onto one of
them with probability ``k / n``. Without the phase the trimmed tails and the
short last block would be sent less often than the rest, and their residuals
would drain more slowly.

A block of ``b >= k`` entries is one contiguous run of ``k`` entries at a
random place: the method before issue 16, which diverges on real CNNs (a
run of ``k`` entries is one or two whole rows of a weight matrix, so a few
neurons get about ``1 / density`` steps of gradient at once). A block of 1 is
random-k. All random numbers come from the unit's seed
``derive_seed(seed, step, key, rank)``: the phase from its bits, the block
draws from its SplitMix64 hashes, so every rank can recompute every other
rank's blocks and resuming is exact.

Example::

    >>> import torch
    >>> from ddp_hooks.sparsify.selectors.random_block import random_blocks
    >>> idx = random_blocks(offsets=[0, 100], sizes=[100, 1000], ks=[10, 50], keys=[0, 1], block_size=4,
    ...                     seed=0, step=3, rank=-1, device=torch.device("cpu"))
    >>> idx.numel(), idx[:10].unique().numel(), bool((idx[10:] >= 100).all())
    (60, 10, True)
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from .base import SelectionRequest, Selector
from .draws import derive_seeds, one_plan_per_layout, random_subsets, uniform_below

__all__ = ["RandomBlock", "random_blocks", "blocks_drawn", "BlockPlan", "block_plan"]


def blocks_drawn(numel: int, k: int, block_size: int) -> int:
    """Blocks drawn for a unit: ``ceil(k / b) + 1``, at most the unit's number of blocks."""
    return min(-(-k // block_size) + 1, -(-numel // block_size))


class BlockPlan(NamedTuple):
    """Device tensors of one layout of units; only the phases and the drawn blocks change per step."""

    total: int  # entries in all (the sum of the budgets)
    block_offsets: Tuple[int, ...]  # each unit's first block index, units laid end to end
    block_counts: Tuple[int, ...]  # blocks per unit
    draws: Tuple[int, ...]  # blocks drawn per unit
    unit: torch.Tensor  # unit of each drawn block
    first_draw: torch.Tensor  # index of each unit's first drawn block
    block_start: torch.Tensor  # per unit: its first block index (tensor form of block_offsets)
    size: torch.Tensor  # per unit: n
    offset: torch.Tensor  # per unit: its first absolute position
    ks: torch.Tensor  # per unit: k
    keys: torch.Tensor  # per unit: the seeding key
    whole: torch.Tensor  # per unit: sent whole (phase 0)
    any_whole: bool


@one_plan_per_layout(budget_args=2)  # ks: a new plan at each step of the density warm-up
def block_plan(offsets: Tuple[int, ...], sizes: Tuple[int, ...], ks: Tuple[int, ...], keys: Tuple[int, ...],
               block_size: int, device: torch.device) -> BlockPlan:
    """The device tensors of one layout of units and budgets, kept for the layout's last budgets (:func:`~.draws.one_plan_per_layout`)."""
    counts = tuple(-(-n // block_size) for n in sizes)
    draws = tuple(blocks_drawn(n, k, block_size) for n, k in zip(sizes, ks))
    block_offsets, at = [], 0
    for c in counts:
        block_offsets.append(at)
        at += c
    draws_t = torch.tensor(draws, device=device)
    whole = [k == n for n, k in zip(sizes, ks)]
    return BlockPlan(
        total=int(sum(ks)), block_offsets=tuple(block_offsets), block_counts=counts, draws=draws,
        unit=torch.repeat_interleave(torch.arange(len(sizes), device=device), draws_t, output_size=sum(draws)),
        first_draw=torch.cumsum(draws_t, 0) - draws_t,
        block_start=torch.tensor(block_offsets, device=device), size=torch.tensor(sizes, device=device),
        offset=torch.tensor(offsets, device=device), ks=torch.tensor(ks, device=device),
        keys=torch.tensor(keys, device=device), whole=torch.tensor(whole, device=device), any_whole=any(whole),
    )


def random_blocks(offsets: Sequence[int], sizes: Sequence[int], ks: Sequence[int], keys: Sequence[int],
                  block_size: int, seed: int, step: int, rank: int, device: torch.device,
                  reads_on_host: Optional[bool] = None) -> torch.Tensor:
    """Absolute positions (int64): ``ks[u]`` entries of unit ``u`` in random blocks, unit by unit.

    Args:
        offsets, sizes (ints): each unit's first position and length.
        ks (ints): each unit's budget, ``1 <= ks[u] <= sizes[u]``.
        keys (ints): each unit's key; with ``seed``, ``step`` and ``rank`` it
            gives the unit's seed.
        block_size (int): entries per block, >= 1.
        device: where the positions are made.
        reads_on_host (bool): passed to :func:`~.draws.random_subsets` (the same blocks either way).

    Within a unit the positions come block by block in draw order; a unit
    sent whole (``k == n``) has phase 0.
    """
    plan = block_plan(tuple(offsets), tuple(sizes), tuple(ks), tuple(keys), int(block_size), torch.device(device))
    b = int(block_size)
    # 3. the drawn blocks (indices laid end to end over the units), in draw order
    drawn = random_subsets(plan.block_offsets, plan.block_counts, plan.draws, tuple(keys), seed, step, rank, device,
                           reads_on_host)
    local = drawn - plan.block_start.index_select(0, plan.unit)  # block index within its unit
    n = plan.size.index_select(0, plan.unit)
    length = torch.minimum(n - local * b, torch.full_like(n, b))  # the unit's last block may be shorter
    # 4. take the blocks in draw order until the unit's k entries are reached
    before = torch.cumsum(length, 0) - length  # entries of earlier blocks, all units
    before -= before.index_select(0, plan.first_draw).index_select(0, plan.unit)  # ... of this unit only
    take = (plan.ks.index_select(0, plan.unit) - before).clamp_(min=0)
    take = torch.minimum(take, length)
    # 1. turn the ring: each block starts at (phase + j b) mod n of its unit, and runs on for `take`
    #    entries, wrapping once if it crosses the end of the unit
    phase = uniform_below(derive_seeds(seed, step, plan.keys, rank), plan.size)
    if plan.any_whole:
        phase.masked_fill_(plan.whole, 0)
    start = local * b + phase.index_select(0, plan.unit)
    start -= n * (start >= n)
    first = start + plan.offset.index_select(0, plan.unit)  # absolute position of each block's first entry
    wraps = (start + take > n).long()
    last = first + take - 1 - n * wraps  # of a block that takes nothing: first - 1, so that the jumps telescope
    # The positions are a running sum of steps: 1 inside a block, a jump at each block's first entry, 1 - n
    # where a block wraps. One cumsum over the k positions, instead of a gather per position; one spare
    # entry at the end receives the jumps of blocks that take nothing after the last entry.
    at = torch.cumsum(take, 0) - take  # each block's first index in the output
    previous_last = torch.cat([last.new_full((1,), -1), last[:-1]])
    steps = torch.ones(plan.total + 1, dtype=torch.int64, device=first.device)
    steps.index_add_(0, at, first - previous_last - 1)
    wrap_at = at + torch.minimum(n - start, take.clamp(min=1) - 1)  # inside the block even without a wrap
    steps.index_add_(0, wrap_at, -n * wraps)
    steps[0] -= 1  # the sum starts from -1 + 1 = the first block's first position
    return torch.cumsum(steps[:-1], 0)


class RandomBlock(Selector):
    """A random set of ``block_size``-entry blocks per unit (the paper's proposal); only values travel."""

    name = "random_block"
    code = 2
    leaves_at_random_times = True
    own_options = ("block_size",)

    def __init__(self, block_size: int = 4) -> None:
        self.block_size = int(block_size)

    @classmethod
    def from_options(cls, options) -> "RandomBlock":
        return cls(block_size=options.block_size)

    def choose(self, request: SelectionRequest, ks: Tuple[int, ...]) -> torch.Tensor:
        units = request.units
        return random_blocks([u.offset for u in units], [u.numel for u in units], ks, [u.key for u in units],
                             self.block_size, request.seed, request.step, request.rank, request.where,
                             request.reads_on_host)
