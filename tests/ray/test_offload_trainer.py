"""offload="disk" through the Trainer: the workers' optimizer state in files under offload_dir;
save at 2 workers (stage 3), restore at 3 (stage 2), resize in place 3 -> 2: the run equals uninterrupted single-process PyTorch within 1e-5, as without offload
(tests/ray/test_checkpoint_resize.py). The files are scratch: the checkpoint holds the state.
An offload_dir that cannot hold the files fails the Trainer's start with a clear error."""
import os

import pytest

import zeroray as zr
from tests.models import lm_loss, parity_model
from tests.ray.test_checkpoint_resize import OPT, SPLIT, check, reference  # noqa: F401 (fixture)


def _zero(folder, stage=3):
    return zr.ZeroConfig(stage=stage, offload="disk", offload_dir=str(folder), offload_chunk_bytes=512)


def test_offload_save_restore_and_resize(ray_local, reference, tmp_path):
    batches, ref = reference
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = str(tmp_path / "ckpt")
    with zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(scratch),
                    scaling=zr.ScalingConfig(num_workers=2)) as trainer:
        for b in batches[:SPLIT]:
            trainer.step(b)
        trainer.save(root)
    assert os.listdir(scratch) == []  # the workers' files are unlinked while open: nothing is left
    with zr.Trainer.restore(root, parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(scratch, stage=2),
                            scaling=zr.ScalingConfig(num_workers=3)) as restored:
        results = [restored.step(b) for b in batches[SPLIT:SPLIT + 2]]
        restored.resize(2)
        results += [restored.step(b) for b in batches[SPLIT + 2:]]
        worst = check(restored, results, ref, SPLIT)
        print(f"save at 2 workers, restore at 3, resize to 2, all with offload: max param diff {worst:.2e}")
    assert os.listdir(scratch) == []


def test_unusable_offload_dir_fails_the_start(ray_local, tmp_path):
    blocker = tmp_path / "a_file"  # a path under a regular file: no directory can be made there, even as root
    blocker.write_text("")
    with pytest.raises(Exception, match=r"offload_dir .*a_file.* cannot be used .*Not a directory") as info:
        zr.Trainer(parity_model, lm_loss, optimizer=zr.AdamW(**OPT), zero=_zero(blocker / "offload"),
                   scaling=zr.ScalingConfig(num_workers=2))
    print(type(info.value).__name__, str(info.value)[:300])
