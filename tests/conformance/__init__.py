"""The differential fuzzer (issue 24 part 5): random models and configurations trained by
zeroray's engine and by single-process PyTorch, compared by a written tolerance rule.

grammar.py (models), configs.py (ZeroConfig and run sizes), data.py (batches), case.py (one
seeded case, the known gaps), oracle.py (PyTorch, DDP's semantics), runner.py (the engine in
one set of torch processes), compare.py (the tolerance rule), driver.py (all of it), ddp.py
(torch DDP, to show the oracle's rules are DDP's). test_conformance.py runs a fixed seeded
set in CI; benchmarks/fuzz.py is the command line for many cases and single reruns.
"""
