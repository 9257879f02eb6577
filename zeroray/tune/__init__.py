"""Ray Tune trials of zeroray Trainers: hyperparameter sweeps with ASHA, PBT or any Tune scheduler.

Needs Ray Tune (``pip install "zeroray[tune]"``). Each trial is a Tune function trainable that
drives one ``zr.Trainer``; its workers are placed in the trial's own placement group (one
bundle for the trial's driver, one per worker), so Tune's resource accounting holds and no
worker ever runs outside the trial's resources::

    import zeroray as zr
    import zeroray.tune as zt
    from ray import tune

    def train(config, trial):                    # trial: a zt.Trial, made by zt.trainable
        trainer = trial.trainer(model_fn, loss_fn, optimizer=zr.AdamW(lr=config["lr"]))
        trial.fit(trainer, batches, total_steps=100, eval_data=eval_batches, eval_every=10,
                  checkpoint_every=10)

    tuner = tune.Tuner(zt.trainable(train, zr.ScalingConfig(num_workers=2)),
                       param_space={"lr": tune.loguniform(1e-4, 1e-2)},
                       tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=8,
                                                   scheduler=tune.schedulers.ASHAScheduler(time_attr="step")))
    best = tuner.fit().get_best_result()

``trial.fit`` reports every step's ``loss`` (and ``step``, ``grad_norm``, ``eval_loss``,
``eval_<metric>``) to Tune as it comes, and every ``checkpoint_every`` steps a Tune checkpoint
that is a zeroray sharded checkpoint (safetensors + JSON). ``trial.trainer`` continues from the
trial's Tune checkpoint when there is one (a paused, failed or PBT-exploited trial), at the
trial's own worker count. The modules: trainable.py (the trainable and its resources),
trial.py (what a trial's function gets), report.py (the fit callback that reports),
staging.py (where a checkpoint is written before Tune takes it).
"""
from zeroray.tune.trainable import trainable, trial_resources
from zeroray.tune.trial import Trial

__all__ = ["Trial", "trainable", "trial_resources"]
