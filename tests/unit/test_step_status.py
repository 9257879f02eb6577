"""The step's status vector (zeroray/engine/step_status.py): what every rank reads after the sum."""
import math

import torch

from zeroray.engine import step_status


def _sum(vectors):
    return torch.stack(vectors).sum(0).tolist()


def test_every_rank_reads_every_ranks_outcome_the_norm_and_the_extra_values():
    cpu = torch.device("cpu")
    ok = step_status.encode(3, 0, torch.tensor(4.0), torch.tensor(1.5), (0.0, 7.0, 123.0), [1.0, 2.0], cpu)
    failed = step_status.encode(3, 1, None, None, (0.0, 7.0, 123.0), [3.0, 4.0], cpu)
    exited = step_status.encode(3, 2, torch.tensor(5.0), torch.tensor(2.5), (1.0, 6.0, 99.0), [5.0, 6.0], cpu)
    status = step_status.decode(_sum([ok, failed, exited]), 3)
    assert status.failed == [1]
    assert status.norm == 3.0  # sqrt(4 + 5): rank 1 counted nothing
    assert [s.loss for s in status.ranks] == [1.5, 0.0, 2.5]
    assert status.any_exit and not status.agreed  # rank 2 recorded other events
    assert status.extra == [9.0, 12.0]


def test_a_step_where_all_agree_and_a_non_finite_norm():
    cpu = torch.device("cpu")
    vecs = [step_status.encode(2, r, torch.tensor(float("inf")) if r else torch.tensor(1.0), torch.tensor(0.5),
                               (0.0, 4.0, 8.0), [], cpu) for r in range(2)]
    status = step_status.decode(_sum(vecs), 2)
    assert status.failed == [] and not status.any_exit and status.agreed
    assert math.isinf(status.norm) and status.extra == []


def test_a_parameter_is_unused_only_when_no_rank_used_it():
    """One slot per trainable parameter: each rank writes 1 where its backward produced a
    gradient; after the sum, 0 means no rank did, and the bucket values still follow."""
    cpu = torch.device("cpu")
    names = ["a", "b", "c", "d"]
    first = step_status.encode(2, 0, torch.tensor(1.0), torch.tensor(0.5), (0.0, 1.0, 2.0), [7.0], cpu,
                               used=[1.0, 0.0, 0.0, 1.0])
    second = step_status.encode(2, 1, torch.tensor(1.0), torch.tensor(0.5), (0.0, 1.0, 2.0), [8.0], cpu,
                                used=[1.0, 1.0, 0.0, 0.0])
    status = step_status.decode(_sum([first, second]), 2, num_params=len(names))
    assert status.used == [2.0, 1.0, 0.0, 1.0]
    assert status.unused(names) == ["c"]
    assert status.extra == [15.0] and status.failed == [] and status.norm == math.sqrt(2.0)
    # A failed rank still sends its slots (what it marked before failing); the step is not applied anyway.
    failed = step_status.encode(2, 1, None, None, (0.0, 1.0, 2.0), [8.0], cpu, used=[0.0] * 4)
    status = step_status.decode(_sum([first, failed]), 2, num_params=len(names))
    assert status.failed == [1] and status.unused(names) == ["b", "c"]
