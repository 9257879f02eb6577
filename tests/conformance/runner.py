"""Run many fuzz cases on zeroray's engine in one set of plain torch processes (gloo, no Ray).

Process start-up dominates a small case, so one set of ``max(world)`` ranks runs a whole list
of cases in order, each on ranks ``0..case.world-1`` with a process group of its own (as
tests/dist/harness.py's ``run_engines``, whose ``spawn_ranks`` starts and joins the ranks).
Unlike ``run_engines``, a case that fails does not end the set: each rank records the
case's error and goes on. A file barrier between cases (every rank waits until every rank is
done with the previous case) keeps one case's failure from spilling into the next: a rank
whose peers hang in a collective waits for them to time out (``GROUP_TIMEOUT_S``) before
it starts the next rendezvous. Rank 0 picks each case's port just before it uses it. Each case
also joins torch.distributed's default group for its ``loss_fn`` and SyncBatchNorm, as a
worker's setup does ([Note: torch.distributed in user code] in zeroray/comm/user_group.py).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
import traceback
from typing import Callable, List, Optional

import cloudpickle
import torch

from tests.conformance.case import Case
from tests.conformance.configs import warmup
from tests.dist.harness import consolidate, spawn_ranks

GROUP_TIMEOUT_S = 30.0    # a collective the ranks disagree on fails after this long
BARRIER_TIMEOUT_S = 120.0  # a rank that died is given up on after this long


def _worker(rank: int, world: int, blob: bytes, out_dir: str) -> None:
    torch.set_num_threads(1)
    cases = cloudpickle.loads(blob)
    kept = []  # each case's old default group lives until the rank exits (tests/dist/harness.py)
    for index, case in enumerate(cases):
        if index:
            _barrier(out_dir, index - 1, world)
        if rank < case.config.world:
            try:
                result = _run_case(rank, case, index, out_dir, kept)
            except BaseException:  # noqa: BLE001 - recorded; the case fails, the set goes on
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"case{index}_rank{rank}.pt"))
        open(os.path.join(out_dir, f"done{index}_rank{rank}"), "w").close()


def _barrier(out_dir: str, index: int, world: int) -> None:
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    names = [os.path.join(out_dir, f"done{index}_rank{r}") for r in range(world)]
    while not all(os.path.exists(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.002)


def _port(rank: int, index: int, out_dir: str) -> int:
    """Rank 0 picks a free port and publishes it (atomically: write, then rename)."""
    from zeroray.comm.port import free_port

    path = os.path.join(out_dir, f"port{index}")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no port for case {index}")
        time.sleep(0.002)
    return int(open(path).read())


def _run_case(rank: int, case: Case, index: int, out_dir: str, kept: list) -> dict:
    from zeroray.comm.group import make_torch_group
    from zeroray.comm.user_group import join_default_group, leave_default_group
    from zeroray.engine.batch import batch_size, split_batch
    from zeroray.engine.engine import Engine

    world = case.config.world
    port = _port(rank, index, out_dir) if world > 1 else 0
    # the rendezvous waits as long as the barrier: a set's first case also waits for its peers' start-up
    # (seconds on a loaded machine: 30 s was too short at load 50)
    group = make_torch_group("gloo", rank, world, "127.0.0.1", port, timeout_s=GROUP_TIMEOUT_S,
                             rendezvous_timeout_s=BARRIER_TIMEOUT_S)
    engine = None
    try:
        join_default_group(group, "gloo", GROUP_TIMEOUT_S)
        config = case.config
        engine = Engine(case.model_fn(), case.loss_fn(), config.engine_optimizer(), config.zero_config(), group,
                        seed=case.seed, param_groups=config.group_overrides if config.groups else None,
                        scheduler=warmup if config.scheduler else None)
        losses, norms, skipped, fetch = [], [], [], {"rounds": 0, "plan_exits": 0}
        for batch in case.batches:
            stats = engine.train_step(split_batch(batch, world)[rank], global_rows=batch_size(batch))
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            skipped.append(stats.skipped)
            for key in fetch:  # stage 3: how the case exercised negotiation (reported, not judged)
                fetch[key] += engine.fetch_stats().get(key, 0)
        out = {"losses": losses, "norms": norms, "skipped": skipped, "fetch": fetch,
               "pieces": {name: engine.master_piece(name) for name in engine.layout.param_names},
               "untrained": engine.untrained_state() if rank == 0 else {},
               "aliases": engine.layout.aliases(), "whole_params": engine.whole_params}
        if case.evaluate:  # the inference calls of branch evalrun (Engine.evaluate, Engine.run)
            share = split_batch(case.eval_batch, world)[rank]
            out["eval_loss"] = engine.evaluate(share)["loss"]
            out["eval_output"] = engine.run(case.logits_fn(), share)
        return out
    finally:
        if engine is not None:
            engine.close()
        kept.append(leave_default_group())
        group.close()


class RankResults:
    """What the ranks of one case returned: per-rank dicts, the consolidated parameters, or an error."""

    def __init__(self, per_rank: List[Optional[dict]]) -> None:
        self.per_rank = per_rank
        errors = [(rank, r["error"]) for rank, r in enumerate(per_rank) if r is not None and "error" in r]
        missing = [i for i, r in enumerate(per_rank) if r is None]
        self.error: Optional[str] = None  # the cause first (a peer's broken connection is a consequence)
        if errors:
            errors.sort(key=lambda e: "CollectiveError" in e[1].strip().splitlines()[-1])
            self.error = "\n".join(f"rank {rank}:\n{text}" for rank, text in errors)
        elif missing:
            self.error = f"rank(s) {missing} wrote no result (the process died)"
        self.params = consolidate(per_rank) if self.error is None else None

    @property
    def losses(self) -> List[float]:
        """The global loss per step: the mean over ranks of each rank's (micro-batch mean) loss,
        each weighted by its rows where the split is uneven (Engine.train_step)."""
        ranks = self.per_rank
        return [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]


def run_cases(cases: List[Case], while_running: Optional[Callable[[], None]] = None) -> List[RankResults]:
    """Every case in one set of processes; ``while_running`` (the oracles) runs here meanwhile."""
    world = max(c.config.world for c in cases)
    with tempfile.TemporaryDirectory() as out_dir:
        failure: List[BaseException] = []

        def spawn() -> None:
            try:
                spawn_ranks(_worker, world, (world, cloudpickle.dumps(cases)), out_dir,
                            join_s=BARRIER_TIMEOUT_S + 60 * len(cases))
            except BaseException as e:  # noqa: BLE001 - cases without results report it
                failure.append(e)
        thread = threading.Thread(target=spawn)
        thread.start()
        if while_running is not None:
            while_running()
        thread.join()
        out = []
        for index, case in enumerate(cases):
            per_rank = []
            for rank in range(case.config.world):
                path = os.path.join(out_dir, f"case{index}_rank{rank}.pt")
                per_rank.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
            results = RankResults(per_rank)
            if results.error and failure and "wrote no result" in results.error:
                results.error += f"\n{failure[0]}"
            out.append(results)
        return out
