"""fedpilot: personalized federated learning experiments (README.md)."""

import os

# OpenMP threads that wait for work sleep instead of spinning, unless the environment says otherwise; set before torch
# loads its OpenMP runtime (fedpilot imported first: the `fedpilot` command, and every process it starts, inherits it).
# fedpilot runs beside other processes (job workers, a scheduler, other jobs on shared cores), where spinning threads
# take the cores from the processes with work to do (several runs at once on few cores); a run alone loses nothing
# (the figures: bench/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
