"""A covariate-shift federation built offline: every client sees the same ten digits (scikit-learn's bundled 8x8
images, upsampled) through its own "device", a rotation, a stroke width, a contrast polarity and a pixel noise
drawn from the dataset's seed. Labels are spread alike over the clients; only the inputs shift, which is where
input-layer personalization (Pillutla et al., ICML 2022; the per-client feature shifts FedBN normalizes away)
should matter.

Each client draws its own samples: digits picked at random from the 1797, each re-drawn with a small rotation,
scale and shift of its own (as augmentation does), so no two clients hold the same pixels. Client k's device and
samples come from the stream (seed, k) alone: a federation of fewer clients is the first clients of a larger one.
A client's name records its device (`c03_rot+23_stroke-1_inv_noise0.15`), so the per-client tables of a run say
which device each row saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from fedpilot.data.config import Source
from fedpilot.errors import check_memory

if TYPE_CHECKING:
    from fedpilot.data.sources import RawData

STREAM = 33  # the source's own branch of the seed's random streams (the partition and split use [seed, 1])
SOURCE_SIDE = 8  # scikit-learn's digits are 8x8
SCALE_JITTER = 0.1  # a sample's own scale is uniform in 1 +- this
SHIFT_JITTER = 1.0  # and its shift uniform in +- this many output pixels per axis


@dataclass(frozen=True)
class Device:
    """How one client's camera shows a digit: rotated by `rotation` degrees counter-clockwise, strokes thickened
    (> 0) or thinned (< 0) by `stroke` pixels, dark on light when `invert`, plus Gaussian pixel noise of sd
    `noise`."""

    rotation: float
    stroke: int
    invert: bool
    noise: float

    def name(self, client: int, width: int) -> str:
        """The client's name, recording its device."""
        return (f"c{client:0{width}d}_rot{self.rotation:+.0f}_stroke{self.stroke:+d}_"
                f"{'inv' if self.invert else 'pos'}_noise{self.noise:.2f}")


class ShiftedDigitsSource(Source):
    """scikit-learn's digits (offline) seen by `clients` devices, `samples` images each of `size` x `size` pixels.

    A device's rotation is uniform in [-rotation, rotation] degrees, its stroke change uniform in -stroke..stroke
    pixels (a grey erosion or dilation with a 2x2 footprint per pixel), it inverts contrast with probability
    `invert`, and its noise sd is uniform in [0, noise]. Each sample also gets its own rotation, uniform in
    [-jitter, jitter] degrees, and a small scale and shift. The natural client column is `client`; use
    `partition: {kind: natural}`."""

    kind: Literal["shifted_digits"] = "shifted_digits"
    clients: int = Field(20, ge=1, le=10_000)
    samples: int = Field(500, ge=1, le=1_000_000)
    size: int = Field(16, ge=SOURCE_SIDE, le=64)
    rotation: float = Field(45.0, ge=0, le=180)
    stroke: int = Field(1, ge=0, le=3)
    invert: float = Field(0.5, ge=0, le=1)
    noise: float = Field(0.3, ge=0, le=1)
    jitter: float = Field(10.0, ge=0, le=45)

    def load(self, seed: int, downloads: Path) -> RawData:
        """Every client's samples, client after client; `groups` holds each sample's client name."""
        from sklearn.datasets import load_digits

        from fedpilot.data.sources import RawData

        rows = self.clients * self.samples
        check_memory("dataset.source", self.model_dump(include={"clients", "samples", "size"}),
                     rows * self.size**2 * (1 + 3 * 8), f"{rows:,} images of {self.size}x{self.size} pixels")
        bunch = load_digits()
        images = (bunch.images / 16.0).astype(np.float64)
        width = len(str(self.clients - 1))
        xs, ys, groups = [], [], []
        for k in range(self.clients):
            rng = client_stream(seed, k)
            device = draw_device(self, rng)
            picks = pick(len(images), self.samples, rng)
            xs.append(render(images[picks], device, self, rng))
            ys.append(bunch.target[picks])
            groups.append(np.full(self.samples, device.name(k, width), dtype=object))
        return RawData(np.concatenate(xs), np.concatenate(ys).astype(np.int64), np.concatenate(groups),
                       (1, self.size, self.size), scale=1 / 255, class_names=10)


def client_stream(seed: int, client: int) -> np.random.Generator:
    """Client `client`'s own random stream: its device, then its samples."""
    return np.random.default_rng([seed, STREAM, client])


def draw_device(spec: ShiftedDigitsSource, rng: np.random.Generator) -> Device:
    """A device drawn from the source's ranges."""
    return Device(rotation=float(rng.uniform(-spec.rotation, spec.rotation)),
                  stroke=int(rng.integers(-spec.stroke, spec.stroke + 1)),
                  invert=bool(rng.random() < spec.invert),
                  noise=float(rng.uniform(0, spec.noise)))


def devices(spec: ShiftedDigitsSource, seed: int) -> list[Device]:
    """Every client's device under `seed` (as `load` draws them)."""
    return [draw_device(spec, client_stream(seed, k)) for k in range(spec.clients)]


def pick(available: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` source digits: a random order of all of them, repeated (each in a new random order) when more are
    needed, so a client holds every digit about equally often."""
    rounds = -(-count // available)
    return np.concatenate([rng.permutation(available) for _ in range(rounds)])[:count]


def render(images: np.ndarray, device: Device, spec: ShiftedDigitsSource, rng: np.random.Generator) -> np.ndarray:
    """8x8 images in [0, 1] through `device`: uint8 [n, 1, size, size]."""
    pixels = resample(images, device.rotation + rng.uniform(-spec.jitter, spec.jitter, len(images)),
                      rng.uniform(1 - SCALE_JITTER, 1 + SCALE_JITTER, len(images)),
                      rng.uniform(-SHIFT_JITTER, SHIFT_JITTER, (len(images), 2)), spec.size)
    pixels = restroke(pixels, device.stroke)
    if device.invert:
        pixels = 1 - pixels
    pixels = pixels + rng.normal(0, device.noise, pixels.shape) if device.noise else pixels
    return np.round(np.clip(pixels, 0, 1) * 255).astype(np.uint8)[:, None]


def resample(images: np.ndarray, degrees: np.ndarray, scales: np.ndarray, shifts: np.ndarray,
             size: int) -> np.ndarray:
    """Each 8x8 image drawn on a size x size grid (bilinear), rotated by its `degrees` counter-clockwise about the
    centre, scaled by its `scales` and moved by its `shifts` (output pixels); outside the source is background (0)."""
    from scipy.ndimage import map_coordinates

    n = len(images)
    grid = np.arange(size) - (size - 1) / 2
    rows, cols = np.meshgrid(grid, grid, indexing="ij")  # output pixel offsets from the centre
    rows = rows[None] - shifts[:, 0, None, None]
    cols = cols[None] - shifts[:, 1, None, None]
    theta = -np.deg2rad(degrees)[:, None, None]  # rows grow downwards
    unit = SOURCE_SIDE / size / scales[:, None, None]  # source pixels per output pixel
    cos, sin = np.cos(theta), np.sin(theta)
    src_rows = (cos * rows - sin * cols) * unit + (SOURCE_SIDE - 1) / 2
    src_cols = (sin * rows + cos * cols) * unit + (SOURCE_SIDE - 1) / 2
    index = np.broadcast_to(np.arange(n, dtype=np.float64)[:, None, None], src_rows.shape)
    return map_coordinates(images, [index, src_rows, src_cols], order=1, mode="constant", cval=0.0)


def restroke(pixels: np.ndarray, stroke: int) -> np.ndarray:
    """Strokes thickened (grey dilation) or thinned (grey erosion) by |stroke| pixels, image by image."""
    from scipy.ndimage import grey_dilation, grey_erosion

    step = grey_dilation if stroke > 0 else grey_erosion
    for _ in range(abs(stroke)):
        pixels = step(pixels, size=(1, 2, 2))
    return pixels
