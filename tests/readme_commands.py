"""The shell commands of the README's "Ways to run" section, read from the README itself.

The tests that run them (tests/e2e/test_readme_commands.py, tests/e2e/test_job_submission.py)
take them from here, so what runs is what the README says, as written: a command edited there
is the command tested. ``RUNS`` says where each subsection's commands run, and
tests/unit/test_readme_commands.py fails when the README gains a command no one runs.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SECTION = "## Ways to run"

# subsection -> where its commands run, as written
RUNS = {
    "A local script": "tests/e2e/test_readme_commands.py",
    "A notebook": ".ci/run",
    "A job on a Ray cluster": "tests/e2e/test_job_submission.py",
    "Fine-tuning a Hugging Face model": "tests/e2e/test_finetune_hf.py",
    # its driver (tests/e2e/tune_driver.py) runs examples/tune_lr.py's main with the README's arguments
    # on the local multi-node cluster and checks where the trials' workers went
    "Hyperparameter sweeps with Ray Tune": "tests/e2e/test_cluster_tune.py",
}
# Commands .ci/run runs instead of their subsection's test: a long run with nothing to compare,
# kept out of the pytest suite's time.
CI_ONLY = {
    "python examples/train_gpt.py --stage 2 --num-workers 3 --steps 300 --metrics runs/gpt.jsonl",
}
# Commands that cannot run unattended, and what runs in their place.
INTERACTIVE = {
    "pip install jupyterlab && jupyter lab examples/quickstart.ipynb":
        "opens JupyterLab for a person; `jupyter execute` runs the same notebook headless (.ci/run), "
        "and tests/e2e/test_notebook.py cell by cell",
}


def ways_to_run(readme: Path = README) -> Dict[str, List[str]]:
    """Per ``###`` subsection of "Ways to run", the commands of its ``bash`` blocks in order: one
    string per command (backslash continuations joined as bash joins them, a trailing ``# ...``
    comment kept: bash ignores it)."""
    text = readme.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    out: Dict[str, List[str]] = {}
    for part in re.split(r"^### ", section, flags=re.MULTILINE)[1:]:
        title, body = part.split("\n", 1)
        commands = []
        for block in re.findall(r"```bash\n(.*?)```", body, flags=re.DOTALL):
            commands += [c for c in block.replace("\\\n", "").splitlines() if c.strip()]
        if commands:
            out[title.strip()] = commands
    return out


def without_comment(command: str) -> str:
    """The command without a trailing ``  # comment`` (for matching, never for running)."""
    return re.sub(r"\s+#[^'\"]*$", "", command).strip()
