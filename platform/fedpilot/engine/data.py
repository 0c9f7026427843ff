"""The engine's view of a federated dataset: client-major tensors, how stored rows become model inputs, and the
random augmentations of training batches (kornia), drawn for a whole batch plan at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(eq=False)
class ClientData:
    """All samples in one tensor, client after client, with per-split `offsets` / `sizes` [n_clients] into it.

    x holds stored rows (float features, uint8 pixels, token ids); `inputs` turns rows into model inputs: float
    times `scale` when `scale` is set (pixels), then per-channel `(x - mean) / std` when `mean` is set. `augment`
    draws random augmentations of training batches (never used by evaluation).
    """

    x: torch.Tensor
    y: torch.Tensor
    offsets: dict[str, torch.Tensor]
    sizes: dict[str, torch.Tensor]
    scale: float | None = None
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    augment: Augment | None = None

    @property
    def n_clients(self) -> int:
        return len(self.sizes["train"])

    def to(self, device: torch.device | str) -> ClientData:
        """A copy with every tensor on `device`."""
        return ClientData(x=self.x.to(device), y=self.y.to(device), scale=self.scale, augment=self.augment,
                       offsets={k: v.to(device) for k, v in self.offsets.items()},
                       sizes={k: v.to(device) for k, v in self.sizes.items()},
                       mean=None if self.mean is None else self.mean.to(device),
                       std=None if self.std is None else self.std.to(device))

    def clients(self, ids: Sequence[int] | torch.Tensor) -> ClientData:
        """The federation restricted to the clients `ids` (client k here is client ids[k]), sharing the samples."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(ClientData)}  # a subclass's too
        return ClientData(**{**fields, "offsets": {k: v[ids.to(v.device)] for k, v in self.offsets.items()},
                             "sizes": {k: v[ids.to(v.device)] for k, v in self.sizes.items()}})

    def nbytes(self) -> int:
        return self.x.numel() * self.x.element_size() + self.y.numel() * self.y.element_size()

    def gather(self, clients: torch.Tensor, device: torch.device) -> ClientData:
        """The training samples of `clients` alone, on `device` (through pinned memory, copied asynchronously, to a
        GPU): a round's data when the federation's stays on the host. Sizes stay the federation's; the offsets of
        `clients` point into the gathered rows (no other client has rows here)."""
        ids = clients.cpu()
        offsets, sizes = self.offsets["train"].cpu(), self.sizes["train"].cpu()
        rows = client_major_index(offsets[ids], sizes[ids])
        x, y = self.x[rows], self.y[rows]
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        gathered = torch.zeros_like(offsets)
        gathered[ids] = torch.cumsum(sizes[ids], 0) - sizes[ids]
        return ClientData(x=x.to(device, non_blocking=True), y=y.to(device, non_blocking=True), scale=self.scale,
                          offsets={"train": gathered.to(device)}, sizes={"train": sizes.to(device)},
                          mean=None if self.mean is None else self.mean.to(device),
                          std=None if self.std is None else self.std.to(device), augment=self.augment)

    def inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """Model inputs of stored `rows` [..., *sample shape] (on the rows' device)."""
        if self.scale is not None:  # stored pixels: the float copy is this call's own, worked on in place
            rows = rows.to(torch.float32).mul_(self.scale)
        if self.mean is not None:
            mean, std = self.mean.to(rows.device).view(-1, 1, 1), self.std.to(rows.device).view(-1, 1, 1)
            rows = (rows.sub_(mean) if self.scale is not None else rows - mean).div_(std)
        return rows


def client_major_index(offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Indices of the samples of clients with these `offsets` and `sizes` (one split), client after client."""
    starts = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(int(sizes.sum()), device=sizes.device) - starts.repeat_interleave(sizes)
    return offsets.repeat_interleave(sizes) + within


class Augment:
    """Random per-sample augmentations of images [C, H, W] (kornia): `random_crop` (pad by `padding`, crop back to
    the size) and `hflip` (with probability `p`). `draw` takes every sample's parameters for a batch plan at once
    from a seeded generator, so a run is reproducible and does not depend on chunking or the executor."""

    def __init__(self, specs: list[dict[str, Any]], image_shape: tuple[int, int, int]):
        self.specs, self.image_shape = specs, tuple(image_shape)

    def modules(self) -> list[torch.nn.Module]:
        """Fresh kornia modules (they keep the parameters of their last call: one set per use, thread-safe)."""
        from kornia import augmentation as K

        size = self.image_shape[1:]
        make = {"random_crop": lambda s: K.RandomCrop(size, padding=s["padding"]),
                "hflip": lambda s: K.RandomHorizontalFlip(p=s["p"])}
        return [make[s["kind"]](s) for s in self.specs]

    def draw(self, plan_shape: tuple[int, ...], generator: torch.Generator) -> AugmentParams:
        """Parameters of every sample of a plan [K, S, B]: torch's global RNG, forked and seeded from `generator`."""
        count = int(torch.tensor(plan_shape).prod())
        seed = int(torch.randint(2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = [m.forward_parameters(torch.Size([count, *self.image_shape])) for m in self.modules()]
        per_sample = [{k: v.reshape(*plan_shape, *v.shape[1:]) for k, v in p.items() if k != "forward_input_shape"}
                      for p in drawn]
        return AugmentParams(self, per_sample)


@dataclass
class AugmentParams:
    """The drawn parameters of a plan's samples, each [K, S, B, ...]; `rows` cuts a chunk, `apply` augments."""

    augment: Augment
    params: list[dict[str, torch.Tensor]]

    def rows(self, rows: slice) -> AugmentParams:
        return AugmentParams(self.augment, [{k: v[rows] for k, v in p.items()} for p in self.params])

    def apply(self, x: torch.Tensor, rows: Any, steps: Any) -> torch.Tensor:
        """Inputs x [..., C, H, W] of the plan's samples [rows, steps] (int or slice each), augmented."""
        lead = x.shape[:-3]
        flat = x.reshape(-1, *x.shape[-3:])
        for module, params in zip(self.augment.modules(), self.params, strict=True):
            chosen = {k: v[rows, steps].reshape(-1, *v.shape[3:]).to(x.device) for k, v in params.items()}
            chosen["forward_input_shape"] = torch.tensor(flat.shape)
            flat = module(flat, params=chosen)
        return flat.reshape(*lead, *flat.shape[1:])
