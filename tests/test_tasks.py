"""Tasks beyond class labels: next-token and regression scores, text to tokens (vocabularies from the training split
only, packed windows), augmentation of training batches; every executor equals the sequential one on them."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from torch import nn

from engine_fixtures import TinyCNN, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.data.config import DatasetSpec, TextSpec
from fedpilot.data.federated import build_federated_data
from fedpilot.data.text import pack_windows, pad_to
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.data import Augment, ClientData
from fedpilot.engine.task import NextToken, Regression, make_task
from fedpilot.models.zoo import build_model
from fedpilot.pipeline.checks import client_data
from fedpilot.testing import EXECUTIONS

SPECIALS = {"pad": 0, "unk": 1, "bos": 2, "eos": 3}


def one_hot(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).float() * 10


def test_next_token_accuracy_counts_real_tokens_and_the_loss_every_non_padding_target():
    task = NextToken(**SPECIALS)
    y = torch.tensor([[4, 5, 3, 0], [1, 6, 2, 0]])  # eos, pad / unk, bos are not real tokens
    predicted = y.clone()
    predicted[0, 2] = predicted[1, 0] = 7  # wrong only where a target is not a real token
    scores = task.scores(one_hot(predicted, 8), y)
    hits, real = scores["acc"]
    assert real.tolist() == [2, 1] and hits.tolist() == [2, 1]  # accuracy 1 over the real tokens
    loss, counted = scores["loss"]
    assert counted.tolist() == [3, 3] and bool((loss > 0).all())  # the wrong eos / unk predictions cost loss
    batch_loss, batch_acc = task.loss(one_hot(predicted, 8), y, torch.tensor([1.0, 0.0]))
    assert float(batch_acc) == 1.0 and float(batch_loss) == pytest.approx(float(loss[0]) / 3)


def test_regression_scores_are_per_sample_mse_and_mae():
    task = Regression()
    output, y = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0])
    scores = task.scores(output, y)
    assert scores["mse"][0].tolist() == [1.0, 4.0] and scores["mae"][0].tolist() == [1.0, 2.0]
    assert not task.higher_is_better and task.primary == "mse"
    assert make_task("regression").metrics == ("mse", "mae")


def test_pack_windows_cover_every_next_token_pair_once():
    windows = pack_windows([[10, 11, 12], [13]], seq_len=3, ids=SPECIALS, pack=True)
    stream = [2, 10, 11, 12, 3, 2, 13, 3]
    pairs = {(int(a), int(b)) for w in windows for a, b in zip(w[:-1], w[1:], strict=True) if b != 0}
    assert pairs == set(zip(stream[:-1], stream[1:], strict=True)) and windows.shape == (3, 4)
    assert windows[-1].tolist() == [3, 2, 13, 3] or windows[-1][-1] == 0
    assert pack_windows([], 3, SPECIALS, True).shape == (0, 4)
    unpacked = pack_windows([[10, 11, 12, 14, 15], [13]], seq_len=3, ids=SPECIALS, pack=False)
    assert unpacked.tolist() == [[2, 10, 11, 12], [2, 13, 3, 0]]
    assert pad_to([[5, 6, 7], [8]], 2, 0).tolist() == [[5, 6], [8, 0]]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """200 texts of 4 writers: common words plus a word of its own per text, and a label."""
    root = tmp_path_factory.mktemp("texts")
    rows = {"text": [f"the cat sat on mat {'up' if i % 2 else 'down'} word{i}" for i in range(200)],
            "writer": [f"w{i % 4}" for i in range(200)], "label": [i % 2 for i in range(200)],
            "score": [i / 7 for i in range(200)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(root / "texts.parquet"))
    return root / "texts.parquet"


def text_data(path, tmp_path, **dataset):
    source = {"kind": "hf", "path": str(path), "feature": "text", "label": "label", "partition_column": "writer"}
    spec = DatasetSpec.from_dict({"source": source, "partition": {"kind": "natural", "min_size": 5}, **dataset})
    return build_federated_data(spec, 0, tmp_path)


def test_vocabulary_comes_from_the_training_split_only(texts, tmp_path):
    data = text_data(texts, tmp_path, text={"tokenizer": "word", "vocab_size": 1000, "seq_len": 12})
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(data.folder / "tokenizer.json")).get_vocab()
    own_words = {w for w in vocab if w.startswith("word")}
    assert len(own_words) == int(data.sizes["train"].sum())  # every text's own word, train texts only
    assert vocab["[PAD]"] == 0 and vocab["[UNK]"] == 1 and data.feature_shape == (12,)
    for split in ("val", "test"):
        for c in range(data.n_clients):
            rows = data.x[data.rows(split, c)]
            assert bool((rows == SPECIALS["unk"]).any(1).all())  # their own word is out of the vocabulary
    assert data.x.dtype == np.int64 and data.task == "classification" and data.num_classes == 2
    assert bool((data.x[:, 7:] == 0).all())  # 7 words, padded to 12


def test_next_token_windows_and_the_tokenizer_in_the_fingerprint(texts, tmp_path):
    data = text_data(texts, tmp_path / "a", task="next_token", text={"tokenizer": "char", "seq_len": 16})
    assert data.y is None and data.x.shape[1] == 17 and data.num_classes == data.vocab_size
    tensors = client_data(data)
    assert torch.equal(tensors.x[:, 1:], tensors.y[:, :-1])  # targets are the inputs shifted: one array
    first = np.asarray(data.x[data.rows("train", 0)])
    assert first[0, 0] == SPECIALS["bos"] and first[1, 0] == first[0, -1]  # windows overlap by one token
    saved = tmp_path / "tokenizer.json"
    saved.write_text((data.folder / "tokenizer.json").read_text())
    again = text_data(texts, tmp_path / "b", task="next_token", text={"tokenizer": str(saved), "seq_len": 16})
    assert np.array_equal(again.x, data.x)  # the saved tokenizer gives the same ids
    saved.write_text(saved.read_text().replace('"e"', '"E"'))
    edited = text_data(texts, tmp_path / "b", task="next_token", text={"tokenizer": str(saved), "seq_len": 16})
    assert edited.fingerprint != again.fingerprint and not edited.cache_hit
    with pytest.raises(ValueError, match="dataset.text.tokenizer='bpe'"):
        TextSpec(tokenizer="bpe")


def test_regression_targets(texts, tmp_path):
    source = {"kind": "hf", "path": str(texts), "feature": "label", "label": "score"}
    data = build_federated_data(DatasetSpec.from_dict({"source": source, "task": "regression",
                                                       "partition": {"kind": "iid", "clients": 4}}), 0, tmp_path)
    assert data.y.dtype == np.float32 and data.num_classes == 1 and data.task == "regression"


# ---- the engine on the new tasks: every executor equals the sequential one --------------------------------------
def token_data(vocab: int = 12, length: int = 6, next_token: bool = True) -> ClientData:
    """12 clients of random token windows (next-token targets, or a label per sequence)."""
    base = ToyData()
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(4, vocab, (len(base.y), length + 1), generator=g)
    windows[::5, -2:] = 0  # some padding
    x, y = (windows[:, :-1], windows[:, 1:]) if next_token else (windows[:, :-1], base.y % 3)
    return ClientData(x, y, base.offsets, base.sizes)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 12):
        super().__init__()
        net = build_model("transformer", (6,), vocab, d_model=8, n_layers=1, n_heads=2)
        self.body, self.head = net.body, net.head

    def forward(self, x):
        return self.head(self.body(x))


def run(model_fn, personal, data, task, execution, chunk, algorithm="fedalt", local=None, rounds=3):
    torch.manual_seed(0)
    model = model_fn()
    names = [n for n, _ in model.named_parameters() if any(n.startswith(p) for p in personal)]
    config = StageConfig(rounds=rounds, clients_per_round=7, max_parallel_clients=chunk, eval_every=rounds,
                         local=local or LocalConfig(steps=2, batch_size=4, lr=0.1))
    stage = stage_for(model, names, data, build_algorithm(algorithm), config, seed=5, task=task)
    stage.executor_choice.pin(execution)
    fit(stage)
    return {n: p.detach().clone() for n, p in stage.model.named_parameters()}, stage


def assert_same(a: dict, b: dict) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("case", ["next_token", "text_classification", "regression", "char_lstm"])
def test_executors_match_sequential_on_the_new_tasks(case):
    if case == "next_token":
        setup = (TinyLM, ["head."], token_data(), NextToken(**SPECIALS))
    elif case == "text_classification":
        def classifier():
            return build_model("text_classifier", (6,), 3, vocab_size=12, d_model=8, n_layers=1, n_heads=2)
        setup = (classifier, ["head."], token_data(next_token=False), make_task("classification"))
    elif case == "regression":
        base = ToyData()
        data = ClientData(base.x, base.y.float() / 3, base.offsets, base.sizes)
        setup = (lambda: build_model("mlp", (16,), 1, hidden=[8]), ["head."], data, Regression())
    else:
        setup = (lambda: build_model("char_lstm", (6,), 12, hidden=8, layers=1), ["head."], token_data(),
                 NextToken(**SPECIALS))
    model_fn, personal, data, task = setup
    reference, stage = run(model_fn, personal, data, task, "sequential", 1)
    executions = [("loop", 3)] if case == "char_lstm" else EXECUTIONS
    for execution, chunk in executions:
        assert_same(run(model_fn, personal, data, task, execution, chunk)[0], reference)
    assert set(stage.client_metrics["test"]) == set(task.metrics)
    recorded = stage.history[-1]
    assert all(f"test_{m}_p10" in recorded for m in task.distributions)
    assert f"train_{task.train_metric}" in stage.round_log


def augmented(**specs) -> ClientData:
    base = ToyData(image=True)
    return ClientData(base.x, base.y, base.offsets, base.sizes,
                      augment=Augment([{"kind": "random_crop", "padding": 1}, {"kind": "hflip", "p": 0.5}],
                                      (1, 4, 4)), **specs)


def test_augmentation_is_the_same_for_every_executor_and_chunking():
    task = make_task("classification")
    reference, _ = run(TinyCNN, ["head."], augmented(), task, "sequential", 1, local=LocalConfig(steps=2,
                                                                                                batch_size=4))
    for execution, chunk in [("loop", 2), ("loop", 7), ("vmap", 3)]:
        got, _ = run(TinyCNN, ["head."], augmented(), task, execution, chunk, local=LocalConfig(steps=2,
                                                                                              batch_size=4))
        assert_same(got, reference)
    plain, _ = run(TinyCNN, ["head."], ToyData(image=True), task, "loop", 2, local=LocalConfig(steps=2,
                                                                                              batch_size=4))
    assert any(not torch.allclose(plain[n], reference[n]) for n in plain)  # augmentation changed training


def test_augmentation_never_applies_at_evaluation():
    _, stage = run(TinyCNN, ["head."], augmented(), make_task("classification"), "loop", 3)
    before = {"test": {m: v.clone() for m, v in stage.client_metrics["test"].items()}}
    stage.data = ToyData(image=True)  # the same samples without augmentations
    stage.evaluate(["test"], stage.n_rounds)
    for split, metrics in before.items():
        for metric, values in metrics.items():
            torch.testing.assert_close(stage.client_metrics[split][metric], values, equal_nan=True)
