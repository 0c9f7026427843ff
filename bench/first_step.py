"""The CNN's local steps by each executor the engine times, the batched first step (`loop_batched_first`) among them
(issue 18, "the CNN round itself").

Every FedAvg client starts its first local step from the same broadcast weights, so the engine's `loop_batched_first`
runs that step's forward pass and the gradients through the layers once over all clients' samples and only the
weight gradients per client (engine/shared_start.py). This times --steps local steps of --clients clients (default:
the first step alone, where the batching is), with every executor candidate of the workload's CNN, the candidates
taking turns as in the stage's own trial; it prints each one's best time and its speed-up over the per-client
`loop`, and checks first that every executor steps the clients to the same weights (within 5% of the step).

    python bench/first_step.py [--device cpu] [--clients 50] [--batch 10] [--steps 1] [--repeats 5] [--personal-head]
"""

from __future__ import annotations

import argparse

import torch
from arguments import COUNT, device_name
from torch import nn
from workload import WORKLOADS, build_model

from fedpilot.engine.accel import EXECUTORS, executor_candidates
from fedpilot.engine.accel.timing import fastest
from fedpilot.engine.executor import Batches, StepRule, Tensors, TrainStats, plain_forward
from fedpilot.engine.memory import keep_freed_memory
from fedpilot.engine.task import CLASSIFICATION

LR = 0.05


def local_steps(name: str, model: nn.Module, shared: Tensors, heads: Tensors, x: torch.Tensor,
                y: torch.Tensor) -> Tensors:
    """Every client's steps over its batches x [K, S, B, ...] from the shared weights, with the executor `name`; with
    `heads` (each client's own head [K, ...], frozen) the rest of the model is trained."""
    clients, steps, batch = y.shape
    index = torch.arange(y.numel(), device=x.device).view(clients, steps, batch)
    batches = Batches(x.flatten(0, 2), index, y, torch.ones(clients, steps, batch, device=x.device),
                      torch.ones(clients, steps, dtype=torch.bool, device=x.device))
    trainable = {n: p.expand(clients, *p.shape) for n, p in shared.items() if n not in heads}
    executor = EXECUTORS[name](plain_forward, CLASSIFICATION)
    return executor.train(model, trainable, heads, {}, batches, StepRule(dict.fromkeys(trainable, LR)),
                          TrainStats.zeros(clients, x.device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--clients", type=COUNT, default=50)
    parser.add_argument("--batch", type=COUNT, default=10)
    parser.add_argument("--steps", type=COUNT, default=1, help="local steps per client (the workload's epoch: 2)")
    parser.add_argument("--repeats", type=COUNT, default=5)
    parser.add_argument("--personal-head", action="store_true",
                        help="each client's head is its own and frozen, the body trained (FedAlt's and FedRep's shared "
                             "phase)")
    args = parser.parse_args()
    device = torch.device(args.device)
    keep_freed_memory(device)
    work = WORKLOADS["cnn"]
    model = build_model(work).to(device)
    shared = {n: p.detach() for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.clients, args.steps, args.batch, *work.input_shape, generator=generator).to(device)
    y = torch.randint(0, work.classes, (args.clients, args.steps, args.batch), generator=generator).to(device)
    heads = {n: p + 0.01 * torch.randn(args.clients, *p.shape, generator=generator).to(device)
             for n, p in shared.items() if n.startswith("head.")} if args.personal_head else {}

    candidates = executor_candidates(model)
    reached = {name: local_steps(name, model, shared, heads, x, y) for name in candidates}
    moved = max((reached["loop"][n] - shared[n]).abs().max().item() for n in reached["loop"])
    for name, trained in reached.items():
        off = max((trained[n] - reached["loop"][n]).abs().max().item() for n in trained)
        if off > 0.05 * moved:  # rounding differs between layouts and vmap (up to ~4% measured); a wrong step ~100%
            raise SystemExit(f"{name}: clients' weights differ from the loop's by {off:.3g} "
                             f"(the steps moved {moved:.3g})")

    seconds = fastest(candidates, lambda name: local_steps(name, model, shared, heads, x, y), device,
                      repeats=args.repeats, out_of_the_running=float("inf")).seconds
    start = "the same body, each client's own head" if heads else "the same weights"
    print(f"\n## {args.steps} local step(s) of {args.clients} CNN clients at batch {args.batch} from {start} "
          f"({device}, {torch.get_num_threads()} threads; best of {args.repeats}, executors taking turns)\n")
    print("| executor | seconds | speed-up over `loop` |\n|---|---:|---:|")
    for name, s in seconds.items():
        print(f"| {name} | {s:.4f} | {seconds['loop'] / s:.2f}x |")


if __name__ == "__main__":
    main()
