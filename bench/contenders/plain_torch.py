"""The typical research loop in plain PyTorch: clients one after another, torch.optim.SGD, a weighted mean.

`--model-per-client fresh` builds a new model for each client (the common `Net()` + load_state_dict);
`reuse` loads the global weights into one model kept across clients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import RoundClock, build_model, contender_args, load_data, local_batches, report, sample_cohort  # noqa: E402


def main() -> None:
    args = contender_args(__doc__, {"--model-per-client": {"choices": ["reuse", "fresh"], "default": "reuse"}})
    work, device = args.workload, torch.device(args.device)
    x_all, y_all = load_data(work)
    global_model = build_model(work).to(device)
    model = build_model(work).to(device)
    clock = RoundClock(args.device)
    for r in range(args.rounds):
        clock.start()
        total = {n: torch.zeros_like(v) for n, v in global_model.state_dict().items()}
        for client in sample_cohort(work, r):
            local = build_model(work).to(device) if args.model_per_client == "fresh" else model
            local.load_state_dict(global_model.state_dict())
            optimizer = torch.optim.SGD(local.parameters(), lr=work.lr)
            x = torch.from_numpy(np.ascontiguousarray(x_all[client])).to(device)
            y = torch.from_numpy(np.ascontiguousarray(y_all[client])).to(device)
            for batch in local_batches(work, client, r):
                optimizer.zero_grad()
                F.cross_entropy(local(x[batch]), y[batch]).backward()
                optimizer.step()
            for name, value in local.state_dict().items():
                total[name].add_(value, alpha=len(y))
        global_model.load_state_dict({n: t / (len(y) * work.clients_per_round) for n, t in total.items()})
        clock.stop()
    report(args.out, f"plain-{args.model_per_client}", work, clock.times, args.warmup)


if __name__ == "__main__":
    main()
