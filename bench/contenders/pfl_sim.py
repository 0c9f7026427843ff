"""pfl-research (`pfl`, Apple's simulation framework) on the shared workload.

FederatedAveraging with a SimulatedBackend in one process: PyTorchModel with torch.optim.SGD locally and a
central SGD with lr 1 (= plain FedAvg), a FederatedDataset of the 1000 clients sampled with pfl's
`minimize_reuse` sampler, no evaluation. Round time: between consecutive after_central_iteration callbacks.
Runs only in bench/.venvs/pfl (bench/peers/setup.sh).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import build_model, contender_args, load_data, report  # noqa: E402


def main() -> None:
    args = contender_args(__doc__)
    work, device = args.workload, torch.device(args.device)
    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    class PflNet(type(build_model(work))):
        """The workload's model with the loss and metrics methods pfl asks for."""

        def loss(self, x, y, eval=False):
            return F.cross_entropy(self(x), y)

        def metrics(self, x, y, eval=False):
            return {"loss": Weighted(float(F.cross_entropy(self(x), y, reduction="sum")), len(y))}

    net = build_model(work)
    net.__class__ = PflNet
    net = net.to(device)
    x_all, y_all = load_data(work)

    def client_dataset(client: int) -> Dataset:
        return Dataset(raw_data=[torch.from_numpy(np.array(x_all[client])).to(device),
                                 torch.from_numpy(np.array(y_all[client])).to(device)])

    clients = list(range(work.clients))
    training = FederatedDataset(client_dataset, get_user_sampler("minimize_reuse", clients))
    backend = SimulatedBackend(training_data=training, val_data=None)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    times: list[float] = []

    class RoundTimes(TrainingProcessCallback):
        def on_train_begin(self, *, model):
            self.last = time.perf_counter()
            return super().on_train_begin(model=model)

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now
            return False, type(aggregate_metrics)()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=work.clients_per_round, val_cohort_size=None),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=work.lr, local_num_epochs=work.epochs,
                                              local_batch_size=work.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[RoundTimes()], send_metrics_to_platform=False)
    report(args.out, "pfl", work, times, args.warmup, version=pfl.__version__)


if __name__ == "__main__":
    main()
