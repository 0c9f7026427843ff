"""Text to token ids with Hugging Face `tokenizers`: a character- or word-level vocabulary built on the training
split only, special tokens with fixed ids, and the two layouts the tasks use (packed next-token windows, and one
truncated/padded sequence per sample)."""

from __future__ import annotations

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
