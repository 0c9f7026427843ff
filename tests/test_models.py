"""Model zoo and ParamSplit: shapes, defaults, presets, adapters that start as the identity, vmap-friendliness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

from fedpilot.errors import SpecError
from fedpilot.models.options import MODELS, PRESETS
from fedpilot.models.split import Adapter, apply_split
from fedpilot.models.zoo import build_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"

# Tiny versions for fast tests: (input_shape, classes, options).
SMALL = {
    "logreg": ((1, 8, 8), 10, {}),
    "mlp": ((1, 8, 8), 10, {"hidden": [16, 12]}),
    "cnn": ((1, 12, 12), 7, {"hidden": 16}),
    "resnet18": ((3, 8, 8), 10, {"width": 4}),
    "transformer": ((12,), 20, {"d_model": 16, "n_heads": 2}),
    "char_lstm": ((12,), 20, {"hidden": 8}),
    "text_classifier": ((12,), 3, {"vocab_size": 20, "d_model": 16, "n_heads": 2}),
}
TOKENS = {"transformer", "char_lstm", "text_classifier"}
SEQUENCE_OUTPUTS = {"transformer", "char_lstm"}  # logits at every position
ADAPTABLE = [n for n in MODELS if n != "logreg"]


def block(name: str, index: int) -> set[str]:
    """The parameter names of transformer block `index` of a small model."""
    return {n for n, _ in small(name).named_parameters() if n.startswith(name == "transformer" and f"body.{index}." or
                                                                          f"body.encoder.{index}.")}


FIRST_LAYER = {
    "logreg": {"head.weight", "head.bias"},  # the body is a parameterless Flatten
    "mlp": {"body.1.weight", "body.1.bias"},
    "cnn": {"body.0.weight", "body.0.bias"},
    "resnet18": {"body.0.weight"},
    "char_lstm": {"body.embed.weight"},
}
# Pillutla et al. (ICML 2022) personalize the first / last transformer block of a large-vocabulary model, not
# embeddings / output layer
BLOCKS = {"transformer": (1, 2), "text_classifier": (1, 2)}


def small(name: str) -> nn.Module:
    shape, classes, options = SMALL[name]
    torch.manual_seed(0)
    return build_model(name, shape, classes, **options)


def batch(name: str, n: int = 3) -> torch.Tensor:
    shape, classes, _ = SMALL[name]
    return torch.randint(0, 20, (n, *shape)) if name in TOKENS else torch.rand(n, *shape)


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_and_contract(name):
    model = small(name)
    x = batch(name)
    out = model(x)
    torch.testing.assert_close(out, model.head(model.body(x)))
    classes = SMALL[name][1]
    assert out.shape == ((3, 12, classes) if name in SEQUENCE_OUTPUTS else (3, classes))
    assert [n for n, _ in model.named_children()] == ["body", "head"] and isinstance(model.head, nn.Linear)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert not list(model.buffers())


@pytest.mark.parametrize(("name", "shape", "classes", "expected"), [
    ("logreg", (1, 8, 8), 10, 650),
    ("mlp", (1, 8, 8), 10, 15_010),
    ("cnn", (1, 28, 28), 62, 1_690_046),
    ("resnet18", (3, 32, 32), 10, 11_173_962),
    ("transformer", (80,), 80, 427_600),
])
def test_config_files_build_the_default_models(name, shape, classes, expected):
    options = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    assert (CONFIGS / f"{name}.yaml").read_text().startswith("# @package model\n")
    model = build_model(options.pop("name"), shape, classes, **options)
    assert numel(model) == numel(build_model(name, shape, classes)) == expected


def test_models_take_any_image_size_and_sequence_length():
    assert build_model("cnn", (3, 20, 36), 5)(torch.rand(2, 3, 20, 36)).shape == (2, 5)
    assert build_model("resnet18", (1, 9, 9), 4, width=4)(torch.rand(2, 1, 9, 9)).shape == (2, 4)
    lm = build_model("transformer", (8,), 30, vocab_size=50, context=16, d_model=8, n_heads=2)
    assert lm(torch.randint(0, 50, (2, 5))).shape == (2, 5, 50)


def test_transformer_is_causal():
    model = small("transformer")
    x = batch("transformer")
    changed = x.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 20
    torch.testing.assert_close(model(changed)[:, :7], model(x)[:, :7])


@pytest.mark.parametrize(("name", "preset"),
                         [(n, p) for n in MODELS for p in PRESETS if n in ADAPTABLE or p != "adapters"])
def test_presets_partition_parameters(name, preset):
    model = small(name)
    split = apply_split(model, preset)
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n in split.personal_names] == split.personal_names
    assert [n for n in names if n in split.shared_names] == split.shared_names
    assert sorted(split.personal_names + split.shared_names) == sorted(names)
    report = split.report()
    assert report["shared_params"] + report["personal_params_per_client"] == report["total_params"] == numel(model)
    assert report["personal_bytes_per_client"] == 4 * report["personal_params_per_client"]
    assert report["shared_bytes"] == 4 * report["shared_params"]
    first, last = (block(name, i) for i in BLOCKS[name]) if name in BLOCKS else (FIRST_LAYER[name], None)
    expected = {"none": set(), "all": set(names), "output_layer": last or {"head.weight", "head.bias"},
                "input_layer": first}
    if preset in expected:
        assert set(split.personal_names) == expected[preset]
    else:
        adapters = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, Adapter)
                    for p, _ in mod.named_parameters()}
        assert adapters and set(split.personal_names) == adapters


@pytest.mark.parametrize("name", ADAPTABLE)
def test_adapters_start_as_identity_keep_names_and_learn(name):
    model = small(name)
    x = batch(name)
    before, names = model(x), [n for n, _ in model.named_parameters()]
    split = apply_split(model, "adapters", adapter_dim=4)
    torch.testing.assert_close(model(x), before)
    assert split.shared_names == names  # existing parameters keep their names, so shared state carries over
    model(x).square().sum().backward()
    adapters = [m for m in model.modules() if isinstance(m, Adapter)]
    assert adapters and all(a.up.weight.grad.abs().sum() + a.up.bias.grad.abs().sum() > 0 for a in adapters)
    assert apply_split(model, "adapters").personal_names == split.personal_names  # not inserted twice


def test_adapter_placement():
    cnn, resnet, lm = small("cnn"), small("resnet18"), small("transformer")
    for model in (cnn, resnet, lm):
        apply_split(model, "adapters")
    adapters = {m: [n for n, a in model.named_modules() if isinstance(a, Adapter)]
                for m, model in [("cnn", cnn), ("resnet18", resnet), ("transformer", lm)]}
    assert adapters["cnn"] == ["body.2.1", "body.5.1", "body.8.1"]  # after each conv stage and the hidden FC
    assert len(adapters["resnet18"]) == 8 and all(n.endswith(".adapter") for n in adapters["resnet18"])
    assert adapters["transformer"] == ["body.1.adapter_attn", "body.1.adapter_mlp", "body.2.adapter_attn",
                                       "body.2.adapter_mlp"]
    assert isinstance(resnet.body[3].adapter.down, nn.Conv2d) and isinstance(lm.body[1].adapter_mlp.up, nn.Linear)
    lstm = small("char_lstm")
    apply_split(lstm, "adapters")
    assert [n for n, a in lstm.named_modules() if isinstance(a, Adapter)] == ["body.adapter"]  # after the LSTM


def test_regex_split_and_param_split_helpers():
    model = small("mlp")
    split = apply_split(model, [r"body\.1\..*", r"head\.bias"])
    assert split.personal_names == ["body.1.weight", "body.1.bias", "head.bias"]
    assert split.shared_names == [
        n for n, _ in model.named_parameters() if n not in split.personal_names]
    params = dict(model.named_parameters())
    assert split.head == {"head.weight": "weight", "head.bias": "bias"} and split.head_only(["head.bias"])
    assert not split.head_only(split.personal_names)
    assert split.from_head(split.in_head(params)) == {n: params[n] for n in split.head}
    assert set(split.in_body(params)) == {n.removeprefix("body.") for n in params if n.startswith("body.")}


def test_spec_errors():
    model = small("mlp")
    with pytest.raises(SpecError, match=r"personalization='nothing\.\*': matches no parameter"):
        apply_split(model, [r"nothing.*"])
    with pytest.raises(SpecError, match="did you mean 'output_layer'"):
        apply_split(model, "output_layers")
    with pytest.raises(SpecError, match="no place for adapters"):
        apply_split(small("logreg"), "adapters")
    with pytest.raises(SpecError, match=r"model.widht=4.*did you mean 'width'"):
        build_model("resnet18", (3, 8, 8), 10, widht=4)
    with pytest.raises(SpecError, match="did you mean 'cnn'"):
        build_model("cnnn", (1, 8, 8), 10)
    with pytest.raises(SpecError, match=r"model.name='cnn': takes images"):
        build_model("cnn", (64,), 10)
    with pytest.raises(SpecError, match="model.n_heads=3"):
        build_model("transformer", (8,), 10, d_model=16, n_heads=3)
    with pytest.raises(SpecError, match="model.groups=3"):
        build_model("resnet18", (3, 8, 8), 10, width=8, groups=3)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # CPU SDPA has no vmap batching rule
@pytest.mark.parametrize(("name", "adapters"), [(n, a) for n in MODELS for a in (False, True)
                                               if (n in ADAPTABLE or not a) and n != "char_lstm"])  # LSTMs loop
def test_vmap_over_stacked_clients_matches_separate_calls(name, adapters):
    models = [small(name) for _ in range(2)]
    torch.manual_seed(1)
    for model in models:
        if adapters:
            apply_split(model, "adapters")
        for p in model.parameters():  # distinct clients, and adapters away from the identity
            p.data.add_(0.1 * torch.randn_like(p))
    params, _ = stack_module_state(models)
    x = torch.stack([batch(name, 2) for _ in range(2)])

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(models[0], p, (xi,)).square().mean()

    out = vmap(lambda p, xi: functional_call(models[0], p, (xi,)))(params, x)
    grads = vmap(grad(loss))(params, x)
    for k, model in enumerate(models):
        torch.testing.assert_close(out[k], model(x[k]), atol=1e-5, rtol=1e-5)
        model.zero_grad()
        model(x[k]).square().mean().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n][k], p.grad, atol=1e-5, rtol=1e-4)
