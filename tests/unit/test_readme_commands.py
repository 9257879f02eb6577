"""Every command of the README's "Ways to run" runs somewhere, as written (tests/readme_commands.py):
a subsection the README gains, or a command .ci/run lacks, fails here, before any slow test."""
from tests.readme_commands import CI_ONLY, INTERACTIVE, ROOT, RUNS, ways_to_run, without_comment


def test_every_subsection_with_commands_has_a_runner():
    sections = ways_to_run()
    assert set(sections) == set(RUNS), f"subsections of 'Ways to run' and their runners differ: {sorted(sections)}"
    for title, where in RUNS.items():
        assert (ROOT / where).is_file(), where
        if where.startswith("tests/"):  # the test reads its commands from the README, not a copy
            assert f'ways_to_run()["{title}"]' in (ROOT / where).read_text(), (title, where)


def test_ci_runs_its_commands_as_written():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = {without_comment(c) for commands in ways_to_run().values() for c in commands}
    assert CI_ONLY <= readme, sorted(CI_ONLY - readme)  # no stale entry
    for title, where in RUNS.items():
        for command in ways_to_run()[title]:
            bare = without_comment(command)
            if where == ".ci/run" or bare in CI_ONLY:
                assert bare in INTERACTIVE or bare in ci, f".ci/run does not run {bare!r} (README, {title})"


def test_the_readme_elastic_pair_is_what_the_local_test_runs():
    plain, _, stop, resume = ways_to_run()["A local script"]
    assert without_comment(plain) == "python examples/train_gpt.py"
    assert "--stop-after 100" in stop and "--resume latest --num-workers 3" in resume
