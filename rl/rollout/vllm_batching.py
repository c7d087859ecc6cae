"""One engine call per step for many training processes (vLLM server mode; TRL's way): each process's request
(its prompts and sampling keywords) is gathered to the main process, identical requests are merged, the server
is asked once, and each process gets back exactly the completions it asked for.

    merged, plan = merge_requests([(prompts_0, sampling_0), (prompts_1, sampling_1)])   # on the main process
    completions = client.generate([p for p, _ in merged], [s for _, s in merged])      # one call
    per_process = split_completions(plan, completions)                                   # per_process[r][i]: prompt i of r

Merging: two rows merge when the prompt and every sampling keyword except `n` are equal (the seed included: two
rows with their own seeds are two requests, so the samples do not depend on how the rows were spread over the
processes); the merged request asks for the sum of their `n`, and each row takes its `n` completions in order.
"""

from __future__ import annotations

import json

import torch.distributed as dist

Request = tuple[list[list[int]], list[dict]]  # prompts, one sampling dict each (vLLM SamplingParams keywords)


def merge_requests(requests: list[Request]) -> tuple[list[tuple[list[int], dict]], list[list[tuple[int, int, int]]]]:
    """Per process (prompts, sampling per prompt) -> the distinct (prompt, sampling) pairs with `n` summed, in
    first-seen order, and the plan: per process, per prompt, (pair index, first completion, count)."""
    index: dict[str, int] = {}
    merged: list[tuple[list[int], dict]] = []
    plan: list[list[tuple[int, int, int]]] = []
    for prompts, samplings in requests:
        rows = []
        for prompt, sampling in zip(prompts, samplings, strict=True):
            n = int(sampling.get("n", 1))
            key = json.dumps([list(map(int, prompt)), {k: v for k, v in sampling.items() if k != "n"}], sort_keys=True)
            if key not in index:
                index[key] = len(merged)
                merged.append((list(map(int, prompt)), {**sampling, "n": 0}))
            j = index[key]
            rows.append((j, merged[j][1]["n"], n))
            merged[j][1]["n"] += n
        plan.append(rows)
    return merged, plan


def split_completions(plan: list[list[tuple[int, int, int]]], completions: list[list]) -> list[list[list]]:
    """The merged call's completions (per distinct pair, its `n` samples) dealt back: per process, per prompt,
    its own samples."""
    return [[completions[j][start:start + n] for j, start, n in rows] for rows in plan]


def generate_across_processes(request: Request, call, group=None, every_rank_calls: bool = False) -> list[list]:
    """Every process of `group` (torch.distributed; default: the launch's) calls this with its request; the
    process of group rank 0 merges them and makes the one engine call `call(prompts, samplings)` ->
    completions per pair, and each process returns its completions per prompt. `every_rank_calls`: every
    process gets every request and makes the same call itself (the shards of one tensor-parallel engine).
    A collective: every process calls it the same number of times (the trainers do: one rollout call per
    step, one per turn of a multi-turn episode)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if every_rank_calls:
        gathered = [None] * world
        dist.all_gather_object(gathered, request, group=group)
        merged, plan = merge_requests(gathered)
        return split_completions(plan, call([p for p, _ in merged], [s for _, s in merged]) if merged else [])[rank]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(request, gathered, dst=src, group=group)
    parts = None
    if rank == 0:
        merged, plan = merge_requests(gathered)
        parts = split_completions(plan, call([p for p, _ in merged], [s for _, s in merged]) if merged else [])
    mine = [None]
    dist.scatter_object_list(mine, parts, src=src, group=group)
    return mine[0]


def local_only(request: Request, call) -> list[list]:
    """`generate_across_processes` for one process: merge (duplicates) and call."""
    merged, plan = merge_requests([request])
    completions = call([p for p, _ in merged], [s for _, s in merged]) if merged else []
    return split_completions(plan, completions)[0]

