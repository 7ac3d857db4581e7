"""What watches a run without changing it. `throughput` gives samples/s, tokens/s, MFU and peak memory
from host arithmetic alone; `holdings` counts what a rank holds in parameters, gradients and optimizer
state; `watch` records the profiler and memory-snapshot windows a recipe asks for and the out-of-memory
report; `hang` names the collective that timed out, in one line per rank. The trackers are in
`launcher.loggers`."""
