"""One rank's engine: composes the layers below into a training step, with its optimizer, mixed
precision, activation checkpointing, batches, step status and evaluate/run calls."""
