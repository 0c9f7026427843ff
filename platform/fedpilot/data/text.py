"""Text to token ids with Hugging Face `tokenizers`: a character- or word-level vocabulary built on the training
split only, special tokens with fixed ids, and the two layouts the tasks use (packed next-token windows, and one
truncated/padded sequence per sample)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from fedpilot.data.config import TextSpec
from fedpilot.errors import SpecError

SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]"}  # ids 0, 1, 2, 3 in a built vocabulary


def build_tokenizer(spec: TextSpec, train_texts: Sequence[str]):
    """A `tokenizers.Tokenizer`: loaded from a tokenizer.json, or trained on `train_texts` (the training split of
    every client) as a word-level vocabulary over characters (`char`) or whitespace-separated words (`word`) of at
    most `vocab_size` entries, the specials first; anything else becomes [UNK]."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if spec.tokenizer not in ("char", "word"):
        tokenizer = Tokenizer.from_file(spec.tokenizer)
        missing = [token for token in SPECIALS.values() if tokenizer.token_to_id(token) is None]
        if missing:
            raise SpecError("dataset.text.tokenizer", spec.tokenizer, f"defines no {', '.join(missing)} token")
        return tokenizer
    tokenizer = Tokenizer(models.WordLevel(unk_token=SPECIALS["unk"]))
    tokenizer.pre_tokenizer = (pre_tokenizers.Split(Regex("."), behavior="isolated") if spec.tokenizer == "char"
                               else pre_tokenizers.WhitespaceSplit())
    trainer = trainers.WordLevelTrainer(vocab_size=spec.vocab_size, special_tokens=list(SPECIALS.values()),
                                        show_progress=False)
    tokenizer.train_from_iterator(train_texts, trainer)
    return tokenizer


def special_ids(tokenizer) -> dict[str, int]:
    """pad, unk, bos, eos -> their ids in `tokenizer`."""
    return {name: tokenizer.token_to_id(token) for name, token in SPECIALS.items()}


def encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (no specials added)."""
    return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def encode_flat(tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the texts (no specials added) as one int32 array, and each text's number of tokens: no Python
    list per text survives the call."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
    return np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int32, int(lengths.sum())), lengths


def stream_of(flat: np.ndarray, lengths: np.ndarray, ids: dict[str, int], chunk: int = 1 << 20) -> np.ndarray:
    """[BOS] ids [EOS] of every sample, concatenated (int32), written `chunk` samples at a time."""
    ends = np.cumsum(lengths + 2)
    starts, token_starts = ends - lengths - 2, np.cumsum(lengths) - lengths
    stream = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
    stream[starts], stream[ends - 1] = ids["bos"], ids["eos"]
    for lo in range(0, len(lengths), chunk):
        hi = min(lo + chunk, len(lengths))
        first, last = int(token_starts[lo]), int(token_starts[hi - 1] + lengths[hi - 1])
        shift = np.repeat(starts[lo:hi] + 1 - (token_starts[lo:hi] - first), lengths[lo:hi])
        stream[shift + np.arange(last - first)] = flat[first:last]
    return stream


def pack_runs(stream: np.ndarray, bounds: np.ndarray, seq_len: int, pad: int,
              progress=None, chunk: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """`pack_windows(..., pack=True)` of each run stream[bounds[g]:bounds[g + 1]] (a client's split), all at once:
    the windows [n, seq_len + 1] (int64), run after run, and each run's number of windows; `progress(done,
    total)` after each `chunk` of windows."""
    length = np.diff(bounds)
    counts = np.where(length > 0, -(-np.maximum(length - 1, 1) // seq_len), 0)
    run = np.repeat(np.arange(len(length)), counts)
    step = np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)
    begin, end = bounds[:-1][run] + step * seq_len, bounds[1:][run]
    out = np.empty((len(run), seq_len + 1), dtype=np.int64)
    offsets = np.arange(seq_len + 1)
    for lo in range(0, len(run), chunk):
        idx = begin[lo : lo + chunk, None] + offsets
        inside = idx < end[lo : lo + chunk, None]
        out[lo : lo + chunk] = np.where(inside, stream[np.where(inside, idx, 0)], pad)
        if progress is not None:
            progress(min(lo + chunk, len(run)), len(run))
    return out, counts


def pack_windows(samples: list[list[int]], seq_len: int, ids: dict[str, int], pack: bool) -> np.ndarray:
    """Next-token windows [n, seq_len + 1] (inputs are [:, :-1], targets [:, 1:]): [BOS] ids [EOS] of each sample,
    concatenated and cut into windows overlapping by one token (`pack`), or one window per sample; the last
    window is padded with [PAD]. No samples, no windows."""
    if not samples:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    streams = [[ids["bos"], *s, ids["eos"]] for s in samples]
    if pack:
        flat = [t for s in streams for t in s]
        streams = [flat[i : i + seq_len + 1] for i in range(0, max(len(flat) - 1, 1), seq_len)]
    return pad_to(streams, seq_len + 1, ids["pad"])


def pad_to(samples: list[list[int]], length: int, pad: int) -> np.ndarray:
    """Each sample truncated or padded with `pad` to `length` tokens, as int64 [n, length]."""
    out = np.full((len(samples), length), pad, dtype=np.int64)
    for i, sample in enumerate(samples):
        out[i, : min(len(sample), length)] = sample[:length]
    return out
