"""A character-level language-modelling corpus from Debian's ``fortunes`` data files.

Debian's ``fortunes`` package (``apt-get install fortunes``) installs about
2.4 MB of English text in ``/usr/share/games/fortunes``: quotations, jokes
and definitions, one file per theme, entries separated by lines holding a
single ``%``. :func:`load_fortunes` reads every text file there (the ``.dat``
indexes and the ``.u8`` links skipped, files in sorted order), puts every
tenth entry into the validation text and the rest into the training text,
and maps characters to ids through the training text's alphabet (a
character seen only in validation maps to the id of ``?``).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

__all__ = ["DEBIAN_FORTUNES", "load_fortunes"]

DEBIAN_FORTUNES = "/usr/share/games/fortunes"


def _entries(folder: str):
    names = sorted(n for n in os.listdir(folder) if not n.endswith((".dat", ".u8")))
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for entry in text.split("\n%\n"):
            entry = entry.strip("%\n")
            if entry:
                yield entry + "\n"


def load_fortunes(folder: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """``(train_ids, valid_ids, alphabet)``: int64 character ids of both texts, and the alphabet.

    Raises ``FileNotFoundError`` with the install command when the folder is missing.
    """
    folder = folder or DEBIAN_FORTUNES
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no fortunes corpus at {folder!r}: install Debian's package with "
                                "`apt-get install fortunes`, or pass the folder of its data files")
    train, valid = [], []
    for i, entry in enumerate(_entries(folder)):
        (valid if i % 10 == 9 else train).append(entry)
    train_text, valid_text = "".join(train), "".join(valid)
    alphabet = "".join(sorted(set(train_text) | {"?"}))
    index = {c: i for i, c in enumerate(alphabet)}
    unknown = index["?"]

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.int64)

    return encode(train_text), encode(valid_text), alphabet
