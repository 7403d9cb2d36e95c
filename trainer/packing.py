"""Which rows go into which forward pass: token-budget packing and balancing over ranks.

Owns: pure planning functions on row lengths (plain Python lists, no tensors):
first-fit-decreasing packing of rows into micro-batches of at most a token budget
(`first_fit_decreasing`), a greedy longest-first split of rows over ranks by tokens
(`balance_ranks`), this rank's micro-batches for the packed path (`packed_micro_batches`:
balanced, packed, padded with empty micro-batches so every rank runs the same number of
forwards, as FSDP's collectives need; `unit_micro_batches` does the same with units that
stay whole: shared-prefix groups, or their parts, from `shared_units`), the right-padded
path's plan (`row_micro_batches`: a contiguous share of the rows in chunks of a row
count), and the tokens a packed pass computes (`unit_tokens`).

Leaves out: tensors (`trainer/packed.py` builds a packed row from a plan's rows), forward
passes (`trainer/forward.py`) and loss normalisation (the minibatch denominator in
`trainer/ppo_trainer.py` makes every plan minimise the same loss).

A plan is a list of micro-batches, each a list of row indices; an empty list is an idle
micro-batch: the rank runs a forward (and backward) that contributes nothing.
"""

from __future__ import annotations

from typing import Sequence

Plan = list[list[int]]


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> Plan:
    """Rows packed into bins of at most `budget` tokens, longest row first, each into the
    first bin it fits; a row longer than `budget` gets a bin of its own.

    Returns the bins in the order they were opened, each bin's rows in ascending order.
    Every row is in exactly one bin.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: Plan = []
    loads: list[int] = []
    for row in order:
        size = lengths[row]
        for b, load in enumerate(loads):
            if load + size <= budget:
                bins[b].append(row)
                loads[b] += size
                break
        else:
            bins.append([row])
            loads.append(size)
    return [sorted(b) for b in bins]


def balance_ranks(lengths: Sequence[int], world: int) -> Plan:
    """Rows split over `world` ranks with balanced token loads (greedy longest-processing-time:
    longest row first, each to the rank with the fewest tokens so far, ties to fewer rows,
    then the lower rank). Returns each rank's rows in ascending order; a rank may get none."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    shares: Plan = [[] for _ in range(world)]
    loads = [0] * world
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], len(shares[r]), r))
        shares[rank].append(row)
        loads[rank] += lengths[row]
    return [sorted(s) for s in shares]


def packed_micro_batches(lengths: Sequence[int], world: int, rank: int, budget: int) -> Plan:
    """This rank's micro-batches on the packed path: rows balanced over ranks by tokens,
    each rank's share packed first-fit decreasing into `budget`-token micro-batches, then
    idle (empty) micro-batches appended up to the busiest rank's count."""
    return unit_micro_batches([[row] for row in range(len(lengths))], lengths, world, rank, budget)


def unit_micro_batches(units: Sequence[Sequence[int]], lengths: Sequence[int], world: int, rank: int,
                       budget: int) -> Plan:
    """`packed_micro_batches` over units that stay whole: each unit (a list of rows, one
    row or a shared-prefix group's part, see `shared_units`) of `lengths[u]` tokens is
    balanced, packed and idled like one row; each micro-batch lists its units' rows in
    ascending order. One-row units in row order give exactly `packed_micro_batches`."""
    plans = []
    for share in balance_ranks(lengths, world):
        bins = first_fit_decreasing([lengths[u] for u in share], budget)
        plans.append([sorted(row for i in b for row in units[share[i]]) for b in bins])
    count = max(1, max(len(plan) for plan in plans))
    mine = plans[rank]
    return mine + [[] for _ in range(count - len(mine))]


def shared_units(segments: Sequence[Sequence[int]], prompts: Sequence[int], responses: Sequence[int],
                 budget: int | None) -> tuple[Plan, list[int]]:
    """(units, their tokens) of a shared-prefix packing. `segments`: rows in groups that
    share a prompt (a one-row segment shares nothing); `prompts[row]`, `responses[row]`:
    each row's prompt and response tokens.

    A segment of several rows is one unit of its prompt once plus its responses; one over
    `budget` is split, its rows in order, into parts of at most `budget` tokens (each at
    least one row), every part with the prompt again. A one-row unit costs prompt +
    response, as unshared. `budget` None: no split.
    """
    units: Plan = []
    tokens: list[int] = []
    for rows in segments:
        if len(rows) == 1:
            units.append([rows[0]])
            tokens.append(prompts[rows[0]] + responses[rows[0]])
            continue
        prompt = prompts[rows[0]]
        part, load = [], prompt
        for row in rows:
            if part and budget is not None and load + responses[row] > budget:
                units.append(part)
                tokens.append(load)
                part, load = [], prompt
            part.append(row)
            load += responses[row]
        units.append(part)
        tokens.append(load)
    return units, tokens


def row_micro_batches(rows: int, world: int, rank: int, micro_batch: int) -> Plan:
    """This rank's micro-batches on the right-padded path: its contiguous share of range(rows)
    (ceil(rows / world) rows, the last ranks fewer or none) in chunks of `micro_batch` rows,
    then idle micro-batches up to the first rank's count."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    share = -(-rows // world)
    step = max(1, micro_batch)
    mine = list(range(min(rows, rank * share), min(rows, (rank + 1) * share)))
    plan = [mine[i : i + step] for i in range(0, len(mine), step)]
    count = max(1, -(-share // step))
    return plan + [[] for _ in range(count - len(plan))]


def unit_tokens(segments: Sequence[Sequence[int]], prompts: Sequence[int], responses: Sequence[int],
                budget: int | None = None) -> tuple[int, int]:
    """(computed, sample) tokens of one packed pass over every row: computed, what the
    shared-prefix units hold (`shared_units`: each prompt once per unit); sample, prompt +
    response of every row (what unshared packing computes). One-row segments: equal."""
    _, tokens = shared_units(segments, prompts, responses, budget)
    return sum(tokens), sum(p + r for p, r in zip(prompts, responses))
