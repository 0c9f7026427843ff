"""The built-in models. Every model is `head(body(x))`: `body` maps inputs to features, `head` is a Linear. Their
registry, their options' schemas and what they read live in fedpilot.models.options (no torch there).

A built-in builder declares no options of its own: `@takes(Schema)` gives it its schema's (names, types and
defaults, declared once in fedpilot.models.options) and hands it the validated schema.

The engine relies on that split (trunk features once when only the head is personal) and on models being
functional-friendly: no BatchNorm (GroupNorm / LayerNorm instead), no state changed in forward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedpilot.errors import SpecError
from fedpilot.models.options import (
    IMAGES,
    MODELS,
    TOKENS,
    CharLstmOptions,
    CnnOptions,
    LogregOptions,
    MlpOptions,
    ModelOptions,
    Resnet18Options,
    TextClassifierOptions,
    TransformerOptions,
    builder_signature,
    check_rank,
    checked,
    option_names,
    validated_options,
)


class Net(nn.Module):
    """body -> head. An algorithm may add modules of its own (pFedGate's `gate`) and apply the model its own way
    (Algorithm.forward); the model's forward stays head(body(x)).

    `presets` maps a personalization preset (`input_layer`, `output_layer`) to the parameters it means for this
    model when that is not the first parametrised module / the head (name regexes)."""

    def __init__(self, body: nn.Module, head: nn.Linear, presets: dict[str, list[str]] | None = None):
        if not (isinstance(body, nn.Module) and isinstance(head, nn.Module)):  # a subclass that forgot its __init__
            raise TypeError(f"Net(body, head) takes two modules, not {type(body).__name__} and {type(head).__name__}")
        super().__init__()
        self.body, self.head = body, head
        self.presets = presets or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


Build = Callable[[tuple[int, ...], int, Any], Net]


def takes(schema: type[ModelOptions]) -> Callable[[Build], Callable[..., Net]]:
    """A built-in builder called as builder(input_shape, num_classes, **options), whose options are `schema`'s: its
    signature shows them, and `build` gets them validated with the defaults filled in."""
    def wrap(build: Build) -> Callable[..., Net]:
        @functools.wraps(build)
        def builder(input_shape: tuple[int, ...], num_classes: int, **options: Any) -> Net:
            return build(tuple(input_shape), num_classes, checked(schema, options))

        builder.__signature__ = builder_signature(schema)  # type: ignore[attr-defined]
        return builder
    return wrap


@takes(LogregOptions)
def logreg(input_shape: tuple[int, ...], num_classes: int, o: LogregOptions) -> Net:
    """Multinomial logistic regression on the flattened input."""
    return Net(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


@takes(MlpOptions)
def mlp(input_shape: tuple[int, ...], num_classes: int, o: MlpOptions) -> Net:
    """Flatten, then Linear+ReLU per hidden size."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in o.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return Net(nn.Sequential(*layers), nn.Linear(width, num_classes))


@takes(CnnOptions)
def cnn(input_shape: tuple[int, ...], num_classes: int, o: CnnOptions) -> Net:
    """The 2-conv CNN of FedAvg (McMahan et al. 2017) for EMNIST/FEMNIST: ~1.7M parameters at 28x28, 62 classes."""
    channels, height, width = check_rank("cnn", input_shape, 3, IMAGES)
    body = nn.Sequential(
        nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * (height // 4) * (width // 4), o.hidden), nn.ReLU(),
    )
    return Net(body, nn.Linear(o.hidden, num_classes))


class BasicBlock(nn.Module):
    """ResNet basic block with GroupNorm; `adapter` is where a Rebuffi adapter goes (ParamSplit "adapters")."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout))
        self.adapter: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return self.adapter(F.relu(self.norm2(self.conv2(out)) + self.shortcut(x)))


@takes(Resnet18Options)
def resnet18(input_shape: tuple[int, ...], num_classes: int, o: Resnet18Options) -> Net:
    """ResNet-18 with GroupNorm (2 groups, as in Hsieh et al. 2020), 3x3 stride-1 stem, no max-pool."""
    channels = check_rank("resnet18", input_shape, 3, IMAGES)[0]
    width, groups = o.width, o.groups
    layers: list[nn.Module] = [nn.Conv2d(channels, width, 3, 1, 1, bias=False), nn.GroupNorm(groups, width),
                               nn.ReLU()]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        cout = width * mult
        layers += [BasicBlock(cin, cout, 1 if i == 0 else 2, groups), BasicBlock(cout, cout, 1, groups)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return Net(nn.Sequential(*layers), nn.Linear(cin, num_classes))


class Embed(nn.Module):
    """Token plus learned position embeddings, both owned here (so they form the "input_layer")."""

    def __init__(self, vocab: int, context: int, d_model: int):
        super().__init__()
        self.tokens = nn.Parameter(0.02 * torch.randn(vocab, d_model))
        self.positions = nn.Parameter(0.02 * torch.randn(context, d_model))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.tokens) + self.positions[: idx.shape[-1]]


class Block(nn.Module):
    """Pre-LayerNorm self-attention (causal unless said) and MLP; the adapter slots take Houlsby adapters
    (ParamSplit)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True):
        super().__init__()
        self.n_heads, self.causal = n_heads, causal
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.adapter_attn: nn.Module = nn.Identity()
        self.adapter_mlp: nn.Module = nn.Identity()

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Attention written out (softmax(q k^T / sqrt(d)) v, as nanoGPT's manual path): torch.func vmaps it with
        batched matmuls, where scaled_dot_product_attention falls back to a loop over clients."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
        if self.causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.adapter_attn(self.attention(self.ln1(x)))
        return x + self.adapter_mlp(self.mlp(self.ln2(x)))


@takes(TransformerOptions)
def transformer(input_shape: tuple[int, ...], num_classes: int, o: TransformerOptions) -> Net:
    """A small GPT-style causal transformer: token ids [B, T] -> next-token logits [B, T, vocab] (the Stack
    Overflow model of Pillutla et al., ICML 2022: 4 layers, d_model 192, configs/model/transformer-so.yaml).

    `vocab_size` defaults to the data's vocabulary (else `num_classes`), `context` (the longest sequence) to the
    input length. Presets: `input_layer` is the first transformer block and `output_layer` the last (Pillutla et al.'s
    choice for a 10,000-word vocabulary, whose embedding and output layers are large), `adapters` Houlsby adapters.
    """
    length = check_rank("transformer", input_shape, 1, TOKENS)[0]
    vocab = o.vocab_size or num_classes
    blocks = [Block(o.d_model, o.n_heads) for _ in range(o.n_layers)]
    body = nn.Sequential(Embed(vocab, o.context or length, o.d_model), *blocks, nn.LayerNorm(o.d_model))
    return Net(body, nn.Linear(o.d_model, vocab), presets=_block_presets(o.n_layers))


def _block_presets(n_layers: int) -> dict[str, list[str]]:
    """input_layer / output_layer = the first / last transformer block of a body [Embed, Block x n, ...]."""
    return {"input_layer": [r"body\.1\..*"], "output_layer": [rf"body\.{n_layers}\..*"]} if n_layers else {}


class Recurrent(nn.Module):
    """A stacked LSTM over embedded tokens: [B, T] -> [B, T, hidden]; `adapter` is where a bottleneck adapter on
    the LSTM's outputs goes (ParamSplit "adapters": nn.LSTM fuses its layers, so there is no slot between them)."""

    def __init__(self, vocab: int, embed_dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.adapter: nn.Module = nn.Identity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.lstm(self.embed(idx))[0])


@takes(CharLstmOptions)
def char_lstm(input_shape: tuple[int, ...], num_classes: int, o: CharLstmOptions) -> Net:
    """LEAF's Shakespeare model: an 8-dimensional character embedding, 2 LSTM layers of 256, next-character logits
    at every position [B, T, vocab]."""
    check_rank("char_lstm", input_shape, 1, TOKENS)
    vocab = o.vocab_size or num_classes
    return Net(Recurrent(vocab, o.embed_dim, o.hidden, o.layers), nn.Linear(o.hidden, vocab))


class PooledEncoder(nn.Module):
    """Token ids [B, T] -> the mean of an encoder's outputs over the real (non-padding) positions [B, d]."""

    def __init__(self, encoder: nn.Module, pad_id: int):
        super().__init__()
        self.encoder, self.pad_id = encoder, pad_id

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        real = (idx != self.pad_id).unsqueeze(-1).to(torch.float32)
        return (self.encoder(idx) * real).sum(-2) / real.sum(-2).clamp_min(1.0)


@takes(TextClassifierOptions)
def text_classifier(input_shape: tuple[int, ...], num_classes: int, o: TextClassifierOptions) -> Net:
    """A sequence classifier (Sent140-like tasks): a bidirectional transformer encoder (or an LSTM, `encoder:
    lstm`) over the tokens, mean-pooled over the real tokens (those that are not `pad_id`, default the data's),
    then a linear head over the classes."""
    pad_id = 0 if o.pad_id is None else o.pad_id
    length = check_rank("text_classifier", input_shape, 1, TOKENS)[0]
    if o.vocab_size is None:
        raise SpecError("model.vocab_size", None, "text_classifier needs a vocabulary: tokenize a text column "
                        "(dataset.text) or give model.vocab_size")
    if o.encoder == "lstm":
        return Net(PooledEncoder(Recurrent(o.vocab_size, o.d_model, o.d_model, o.n_layers), pad_id),
                   nn.Linear(o.d_model, num_classes))
    blocks = [Block(o.d_model, o.n_heads, causal=False) for _ in range(o.n_layers)]
    trunk = nn.Sequential(Embed(o.vocab_size, length, o.d_model), *blocks, nn.LayerNorm(o.d_model))
    presets = {k: [r.replace(r"body\.", r"body\.encoder\.") for r in v]
               for k, v in _block_presets(o.n_layers).items()}
    return Net(PooledEncoder(trunk, pad_id), nn.Linear(o.d_model, num_classes), presets=presets)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, tokens: dict[str, int] | None = None,
                **options: Any) -> Net:
    """The registered model `name` for inputs of `input_shape` and `num_classes` outputs, its `options` checked
    (fedpilot.models.options); `tokens` ({vocab_size, pad_id}) fills a token model's options the pipeline does not
    set. A SpecError when the builder (a plugin's function) returns anything but a Net."""
    options = validated_options(name, options)
    filled = {k: v for k, v in (tokens or {}).items() if k in option_names(name) and options.get(k) is None}
    model = MODELS[name](tuple(input_shape), num_classes, **{**options, **filled})
    if not isinstance(model, Net):
        what = "None" if model is None else f"a {type(model).__module__}.{type(model).__qualname__}"
        raise SpecError("model.name", name, f"its builder returned {what}, not a fedpilot.api.Net (a model is "
                        "head(body(x)))")
    return model

