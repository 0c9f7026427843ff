"""The fast executors and their machinery, behind the core's `Executor`: vmap, vmap_autograd and bmm (every client
of a chunk at once), the loops (one client per core at a time), and what they stand on: linear_graph (a model's
Linear layers as batched matrix products), shared_start (a first step batched over clients), pooling, timing and
threads. The numbers are the sequential reference's (engine/sequential.py); only the speed differs.

The core sees two names of it: `ExecutorChoice` (which executor a stage runs, and the timing that chose it) and
`Evaluator` (the per-client metrics, run the chosen executor's way); `executors` names every executor.
"""

from fedpilot.engine.accel.choice import ExecutorChoice
from fedpilot.engine.accel.evaluate import Evaluator
from fedpilot.engine.accel.executors import (
           AUTO,
           CANDIDATES,
           EXECUTORS,
           choose,
           executor_candidates,
           rule_of_thumb,
)

__all__ = ["AUTO", "CANDIDATES", "EXECUTORS", "Evaluator", "ExecutorChoice", "choose", "executor_candidates",
           "rule_of_thumb"]
