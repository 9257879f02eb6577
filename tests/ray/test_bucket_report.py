"""comm_report() through zr.Trainer carries the gradient buckets of the last step (issue 20)."""
import zeroray as zr
from tests.dist.test_bucket_timeout import paused_model
from tests.models import lm_loss, make_batches


def test_comm_report_shows_buckets_per_step(ray_local):
    with zr.Trainer(paused_model, lm_loss, optimizer=zr.AdamW(lr=1e-2),
                    zero=zr.ZeroConfig(stage=2, bucket_bytes="auto", bucket_timeout_ms=5.0),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        reports = []
        for batch in make_batches(4):
            trainer.step(batch)
            reports.append(trainer.comm_report())
    first, last = reports[0], reports[-1]
    assert [r["buckets_end"] for r in first] == [1, 1] and first[0]["bucket_bytes"] == 16 * 2**20
    for r in last:  # the plan learned after step 2 is followed: the timeout cuts, the size moved
        assert r["buckets_timeout"] >= 3 and r["bucket_bytes"] == 64 * 2**10, r
        assert r["bucket_first_wait_ms"] >= 0 and r["bucket_timeout_ms"] == 5.0
    assert last[0]["bucket_size_changes"] == last[1]["bucket_size_changes"] == [[2, 16 * 2**20, 64 * 2**10]]
