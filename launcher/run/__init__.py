"""One training run, end to end. `train` is the run: place the ranks, open the run folder, build, resume,
fit, close; `assemble` puts the model, strategy, optimizer and checkpoints together; `build` makes the
recipe's components (optimizer, schedule, data, step); `first_batch` runs one batch before training so
that data that does not fit is one line; `loop` is the optimizer step (accumulation, clipping, precision,
evaluation, stopping); `metrics` keeps the running sums on the device and reads them once a log interval
(`launcher.run.metrics.Accuracy`)."""
