"""Flower's simulation engine (flwr[simulation], Ray backend) on the shared workload.

A ClientApp trains one client (a new model loaded with the broadcast weights, torch.optim.SGD, its own
batches); the ServerApp runs Flower's FedAvg (Message API) with fraction_train = clients_per_round / clients
and no client-side evaluation. Round time: from configure_train to the end of aggregate_train.
Each Ray actor gets `--client-cpus` CPUs and as many torch threads, so the machine's cores run clients
in parallel (Flower's recommended setup for CPU simulation); on CUDA each actor also gets `--client-gpus`
of the GPU.
Runs only in bench/.venvs/flower (bench/peers/setup.sh).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import RoundClock, Workload, build_model, contender_args, load_data, local_batches, report  # noqa: E402

WORKLOAD_ENV, DEVICE_ENV = "FEDPILOT_BENCH_WORKLOAD", "FEDPILOT_BENCH_DEVICE"


def client_app():
    """The ClientApp; the workload travels to the Ray actors in an environment variable."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()
    torch.set_num_threads(int(os.environ.get("FEDPILOT_BENCH_CLIENT_CPUS", "1")))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        work, device = Workload.from_json(os.environ[WORKLOAD_ENV]), os.environ[DEVICE_ENV]
        client = int(context.node_config["partition-id"])
        round_idx = int(msg.content["config"]["server-round"])
        x_all, y_all = load_data(work)
        model = build_model(work)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=work.lr)
        x = torch.from_numpy(np.array(x_all[client])).to(device)
        y = torch.from_numpy(np.array(y_all[client])).to(device)
        for batch in local_batches(work, client, round_idx):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
        metrics = MetricRecord({"train_loss": float(loss.detach()), "num-examples": len(y)})
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)

    return app


def server_app(work: Workload, rounds: int, clock: RoundClock):
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            clock.start()
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            result = super().aggregate_train(server_round, replies)
            clock.stop()
            return result

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = TimedFedAvg(fraction_train=work.clients_per_round / work.clients, fraction_evaluate=0.0,
                               min_train_nodes=work.clients_per_round, min_available_nodes=work.clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(build_model(work).state_dict()), num_rounds=rounds)

    return app


def main() -> None:
    args = contender_args(__doc__, {"--client-cpus": {"type": int, "default": 1},
                                    "--client-gpus": {"type": float, "default": 0.25}})
    import flwr
    from flwr.simulation import run_simulation

    os.environ[WORKLOAD_ENV] = args.workload.to_json()
    os.environ[DEVICE_ENV] = args.device
    os.environ["FEDPILOT_BENCH_CLIENT_CPUS"] = str(args.client_cpus)
    gpus = args.client_gpus if args.device.startswith("cuda") else 0.0
    logging.getLogger("flwr").setLevel(logging.WARNING)
    clock = RoundClock()
    run_simulation(server_app=server_app(args.workload, args.rounds, clock), client_app=client_app(),
                   num_supernodes=args.workload.clients,
                   backend_config={"client_resources": {"num_cpus": args.client_cpus, "num_gpus": gpus}})
    if len(clock.times) != args.rounds:
        raise SystemExit(f"Flower finished {len(clock.times)} of {args.rounds} rounds")
    report(args.out, "flower", args.workload, clock.times, args.warmup, version=flwr.__version__,
           client_cpus=args.client_cpus)


if __name__ == "__main__":
    main()
