"""The private torch and transformers APIs zeroray uses, each with what zeroray needs of it, so
that a release that renames or changes one fails here, naming the installed and the tested
version, rather than deep inside a step. pyproject.toml pins the tested ranges; widen one only
once this module (and the tests named beside each API) passes on the new release.

torch (tested with 2.13.0):
- ``ProcessGroupGloo._set_default_timeout``, ``ProcessGroup._allgather_base`` and
  ``_reduce_scatter_base`` (comm/group.py: the collectives' timeout, and the flat all-gather and
  reduce-scatter gloo has no public form of on a ProcessGroup object);
- ``UntypedStorage._swap_data_ptr_`` (memory/unit_pool.py, construct/freed_storage.py: a storage
  takes another's memory in place, every view following);
- ``untyped_storage()._cdata`` (construct/freed_storage.py: one identity for all views of a storage);
- ``torch._debug_has_internal_overlap`` (construct/freed_storage.py);
- ``torch._C.DisableTorchFunctionSubclass`` (fetch/access.py: a parameter subclass's
  ``__torch_function__`` runs the op on the plain tensor);
- ``torch.utils._python_dispatch.TorchDispatchMode`` (construct/freed_storage.py: sees every aten op);
- ``torch.nn.modules.batchnorm._NormBase`` (engine/precision.py: the layers with running statistics).

transformers (tested with 5.24.0; the behaviour is checked in tests/unit/test_hf.py and
tests/unit/test_precision.py, which read some of these too):
- ``PreTrainedModel._no_split_modules`` (layout/wrap.py: the default stage-3 units);
- ``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict`` and ``_get_dtype_plan``
  (engine/precision.py, tests/unit/test_precision.py);
- ``all_tied_weights_keys`` ({target: source}) and ``base_model_prefix`` (hf/architecture.py:
  which names save_pretrained writes);
- rotary buffers named ``inv_freq`` / ``original_inv_freq`` (engine/precision.py keeps them fp32);
- ``from_config(config, dtype=...)`` and ``config.dtype`` (hf/architecture.py, hf/export.py: 5.x's
  names for 4.x's ``torch_dtype``);
- ``transformers.core_model_loading.build_glob_alternation`` (tests/unit/test_precision.py's oracle).
"""
import datetime

import pytest
import torch
import torch.distributed as dist

TORCH_TESTED = "2.13.0"
TRANSFORMERS_TESTED = "5.24.0"


def _torch_changed(what: str) -> str:
    return (f"torch {torch.__version__} (zeroray is tested with torch {TORCH_TESTED}): {what}; keep torch at the "
            "range pyproject.toml gives")


def test_gloo_process_group_private_methods():
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    for name in ("_set_default_timeout", "_allgather_base", "_reduce_scatter_base"):
        assert hasattr(pg, name), _torch_changed(f"ProcessGroupGloo has no {name}")
    pg._set_default_timeout(datetime.timedelta(seconds=60))
    x = torch.arange(6, dtype=torch.float32)
    out = torch.empty(6)
    pg._allgather_base(out, x).wait()
    assert torch.equal(out, x), _torch_changed("_allgather_base no longer gathers flat tensors")
    pg._reduce_scatter_base(out, x).wait()
    assert torch.equal(out, x), _torch_changed("_reduce_scatter_base no longer reduce-scatters flat tensors")


@pytest.mark.skipif(not hasattr(dist, "ProcessGroupNCCL"), reason="a CPU build of torch has no NCCL")
def test_nccl_options_timeout():
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=5)
    assert opts._timeout == datetime.timedelta(seconds=5), _torch_changed("ProcessGroupNCCL.Options has no _timeout")


def test_storage_swap_and_identity():
    a = torch.zeros(8)
    view = a[2:]
    assert view.untyped_storage()._cdata == a.untyped_storage()._cdata, _torch_changed(
        "untyped_storage()._cdata differs between views of one storage")
    memory = torch.ones(8).untyped_storage()
    a.untyped_storage()._swap_data_ptr_(memory)
    assert torch.equal(a, torch.ones(8)) and torch.equal(view, torch.ones(6)), _torch_changed(
        "UntypedStorage._swap_data_ptr_ no longer gives a storage, and every view of it, another's memory")
    assert torch.equal(torch.tensor([], dtype=torch.float32).set_(memory), torch.zeros(8))


def test_internal_overlap_probe():
    assert torch._debug_has_internal_overlap(torch.zeros(4)) == 0
    assert torch._debug_has_internal_overlap(torch.zeros(1).expand(4)) != 0, _torch_changed(
        "torch._debug_has_internal_overlap no longer reports an expanded tensor")


def test_torch_function_subclass_and_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Sub(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    y = Sub(torch.ones(3)) * 2
    assert seen and type(y) is torch.Tensor, _torch_changed(
        "an op under torch._C.DisableTorchFunctionSubclass no longer returns a plain tensor")

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.zeros(2).normal_()
    assert "aten.normal_.default" in seen, _torch_changed("a TorchDispatchMode no longer sees aten ops")


def test_norm_base_is_the_running_stats_layers_base():
    from torch.nn.modules.batchnorm import _NormBase

    for cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.SyncBatchNorm, torch.nn.InstanceNorm1d):
        assert issubclass(cls, _NormBase), _torch_changed(f"{cls.__name__} is no _NormBase")


# --- transformers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _tf_changed(tf, what: str) -> str:
    return (f"transformers {tf.__version__} (zeroray is tested with transformers {TRANSFORMERS_TESTED}): {what}; "
            "keep transformers at the range pyproject.toml gives")


def test_transformers_model_attributes(tf):
    from tests.real_models import gpt2_config, llama_config

    gpt2, llama = tf.GPT2LMHeadModel(gpt2_config()), tf.LlamaForCausalLM(llama_config())
    for model, block, prefix in ((gpt2, "GPT2Block", "transformer"), (llama, "LlamaDecoderLayer", "model")):
        assert set(getattr(model, "_no_split_modules", None) or ()) == {block}, _tf_changed(
            tf, f"{type(model).__name__}._no_split_modules is {getattr(model, '_no_split_modules', None)!r}")
        assert model.base_model_prefix == prefix, _tf_changed(tf, "base_model_prefix changed")
    assert dict(getattr(gpt2, "all_tied_weights_keys", None) or {}) == {"lm_head.weight": "transformer.wte.weight"}, \
        _tf_changed(tf, "all_tied_weights_keys no longer maps a tied target to its source")
    assert not getattr(llama, "all_tied_weights_keys", None)
    for name in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict", "_get_dtype_plan"):
        assert hasattr(tf.PreTrainedModel, name), _tf_changed(tf, f"PreTrainedModel has no {name}")
    buffers = {n.rsplit(".", 1)[-1] for n, _ in llama.named_buffers()}
    assert {"inv_freq", "original_inv_freq"} <= buffers, _tf_changed(tf, f"Llama's rotary buffers are {buffers}")
    from transformers.core_model_loading import build_glob_alternation  # noqa: F401


def test_transformers_dtype_names(tf, tmp_path):
    from tests.real_models import llama_config

    model = tf.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16, _tf_changed(tf, "from_config no longer takes dtype=")
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16, _tf_changed(tf, "from_pretrained no longer loads in config.dtype")
