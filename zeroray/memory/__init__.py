"""The paper's memory model (pure arithmetic, model.py), the measured report beside it (report.py) and
the worker process's memory (process.py). Importing this package imports neither torch nor ray."""
