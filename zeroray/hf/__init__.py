"""Hugging Face models: load a saved model with each worker reading only its own slices, and
export full weights as a directory that ``from_pretrained`` loads.

    import zeroray as zr
    from zeroray.hf import pretrained, export_pretrained, export_checkpoint

    trainer = zr.Trainer(pretrained("path/to/saved_model"), loss_fn, ...)
    export_pretrained(trainer.state_dict(), "out/", config="path/to/saved_model")
    export_checkpoint("ckpts/", "out/", config="path/to/saved_model")   # zeroray export-hf

No Ray in here, and transformers is imported only inside the functions that need it.

[Note: the sliced loading contract]
``pretrained(path)`` returns a ``PretrainedModel``: a picklable ``model_fn``. Whoever builds
the model (the engine, on each worker) does:
1. ``model = model_fn()``, whole or sharded: the architecture from the saved config, random
   init, fp32 (random numbers are drawn as ever, so seeding works as for any model_fn);
2. if ``model_fn`` has ``read_pieces``: ``model_fn.read_pieces({name: (lo, hi)}, aliases)`` for
   the trainable parameters, ``name`` a key of ``model.state_dict()`` and ``[lo, hi)`` the
   flat row-major elements this rank owns (``FlatLayout.param_shard_view``'s range); it
   returns ``{name: 1-D fp32 tensor of hi - lo elements}``, or fills ``out={name: view}``
   (views into the rank's shard, so no second copy of the shard exists). ``aliases`` maps a
   name to other names of the same tied tensor (``ParamSlot.aliases``); the model's own ties
   are found without it;
3. if ``model_fn`` has ``read_whole``: ``model_fn.read_whole(names)`` for the replicated
   tensors (frozen parameters, persistent buffers), copied into the model; names the files
   lack are left out (the model keeps what it was built with, as from_pretrained does).
Every read touches only the bytes asked for, in the files of ``path``: a worker's peak is
its shard, never the model. A name the files lack is a ``CheckpointError`` (a ValueError)
naming it and the files. Models whose transformers loading renames or fuses tensors (the
conversion mappings of some mixture-of-experts models) are not read by slice: load those
whole, ``model_fn=lambda: AutoModelForCausalLM.from_pretrained(path)``.
"""
from zeroray.hf.commands import cli_export_hf
from zeroray.hf.export import DEFAULT_MAX_SHARD_BYTES, ExportPlan, export_checkpoint, export_pretrained, plan_export
from zeroray.hf.files import INDEX_NAME, SINGLE_NAME, SavedWeights
from zeroray.hf.pretrained import PretrainedModel, pretrained

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "ExportPlan", "INDEX_NAME", "PretrainedModel", "SINGLE_NAME",
    "SavedWeights", "cli_export_hf", "export_checkpoint", "export_pretrained", "plan_export",
    "pretrained",
]
