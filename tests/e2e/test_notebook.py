"""examples/quickstart.ipynb, executed top to bottom in a real Jupyter kernel (nbclient).

Between its cells the test also re-runs the cell that builds the Trainer, twice, and checks
the number of live zeroray worker actors stays that of one Trainer: once through the cell's
own `trainer.shutdown()` of the previous Trainer, once with `shutdown` disabled so that only
garbage collection of the rebound `trainer` can release the old one.

The kernel starts its own local Ray (a second instance next to the test session's, which is
fine) and the notebook's last cell shuts it down.
"""
import importlib.util
import json
import os
import re
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
if importlib.util.find_spec("ipykernel") is None:  # not imported here: it would make this process look like a kernel
    pytest.skip("needs ipykernel (the python3 Jupyter kernel)", allow_module_level=True)

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
NOTEBOOK = os.path.join(EXAMPLES, "quickstart.ipynb")

pytestmark = pytest.mark.slow

# Live worker actors of this kernel's Ray, from the GCS actor table (ray.util.state needs the
# dashboard, which zeroray's embedded Ray does not start). Polls: a kill is asynchronous.
COUNT_WORKERS = """
import json, time, ray._private.state
def _alive_workers():
    return sum(1 for a in ray._private.state.actors().values()
               if a["State"] == "ALIVE" and a["ActorClassName"] == "Worker")
_deadline = time.monotonic() + 30
while _alive_workers() != {want} and time.monotonic() < _deadline:
    time.sleep(0.5)
print(json.dumps(_alive_workers()))
"""

DISABLE_SHUTDOWN = """
import weakref
_previous = weakref.ref(trainer)
_shutdown, zr.Trainer.shutdown = zr.Trainer.shutdown, lambda self: None  # only GC can release it now
"""

RESTORE_SHUTDOWN = """
zr.Trainer.shutdown = _shutdown
import gc; gc.collect()
print(json.dumps(_previous() is None))
"""


def _stdout(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_quickstart_notebook():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                     resources={"metadata": {"path": EXAMPLES}})
    build = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "zr.Trainer(" in c.source)
    cells = list(nb.cells)
    scratch = len(nb.cells)  # a slot past the notebook's cells for the test's own cells (nbclient stores them)
    nb.cells.append(nbformat.v4.new_code_cell(""))

    def run(source):
        cell = nbformat.v4.new_code_cell(source)
        client.execute_cell(cell, scratch)
        return json.loads(_stdout(cell).strip().splitlines()[-1])

    timings = {}
    with client.setup_kernel():
        for index, cell in enumerate(cells):
            if cell.cell_type != "code":
                continue
            t0 = time.perf_counter()
            client.execute_cell(cell, index)  # raises CellExecutionError on an error
            timings[index] = time.perf_counter() - t0
            if index == build:
                assert run(COUNT_WORKERS.format(want=2)) == 2
                client.execute_cell(nbformat.v4.new_code_cell(cell.source), scratch)  # re-run
                assert run(COUNT_WORKERS.format(want=2)) == 2, "re-running the cell leaked the old Trainer"
                run(DISABLE_SHUTDOWN + "print(1)")
                client.execute_cell(nbformat.v4.new_code_cell(cell.source), scratch)  # rebinds
                assert run(RESTORE_SHUTDOWN) is True, "the rebound Trainer was not garbage collected"
                assert run(COUNT_WORKERS.format(want=2)) == 2, "a garbage-collected Trainer kept its workers"
    print(f"notebook cells ran in {sum(timings.values()):.1f}s "
          f"(slowest: {', '.join(f'cell {i} {t:.1f}s' for i, t in sorted(timings.items(), key=lambda x: -x[1])[:3])})")

    code = [c for c in nb.cells[:scratch] if c.cell_type == "code"]
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    text = "\n".join(_stdout(c) for c in code)
    first, last = map(float, re.search(r"step 30: loss ([\d.]+) -> ([\d.]+)", text).groups())
    assert last < first - 1.0, text
    assert "blocks.0.qkv.weight: shape (192, 64)" in text
    assert len(re.findall(r"worker \d: params \d+ KiB", text)) == 2
    assert "step_00000030" in text and "3 workers, step 30" in text and "step 50: loss" in text
    eval_loss = float(re.search(r"step 50: loss [\d.]+, eval loss ([\d.]+)", text).group(1))
    assert eval_loss < first - 1.0, text  # evaluated on other batches, after training
    sample = re.search(r"sample: (.*)", text, re.S).group(1)
    assert sample.startswith("The ") and len(sample.encode("utf-8", errors="replace")) >= 80, sample
    errs = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream" and o.name == "stderr")
    assert "zeroray: 100%" in errs and "20/20" in errs  # fit's progress bar (the text one without ipywidgets)
    sweep = re.findall(r"lr (\de-\d\d): eval loss ([\d.]+) at step 10, 2 workers", text)  # the Ray Tune section
    assert sorted(lr for lr, _ in sweep) == ["3e-03", "3e-04"], text
    assert "best lr: 3e-03" in text and min(float(v) for _, v in sweep) < first - 1.0, text
    plots = [o for c in code for o in c.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(plots) == 2
