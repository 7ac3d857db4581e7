"""The fault tolerance row (--ft): row.py (replica groups against ddp; a process killed mid-step against a restart
from a checkpoint) and dying.py (the step that kills its own process). Tested by tests/test_bench.py (the fault
tolerance row)."""
