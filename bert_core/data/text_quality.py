"""Is a text file language, or junk that decodes? The check `bert clean` and `bert vocab` make.

Random bytes, a binary file with a .txt name or a file in the wrong encoding still "decode":
`bert clean` replaces invalid UTF-8 by U+FFFD (a few stray Latin-1 bytes in an old book are
normal), and a file of control characters is valid UTF-8. Left alone, the pipeline turns such a
file into a vocabulary of junk pieces and a model trained on noise, with exit code 0. So the
readers count the characters no language uses (C0/C1 controls other than whitespace, U+FFFD,
private-use code points) and refuse a file where they are more than `MAX_JUNK_SHARE` of the
text, naming the file and the first such line. Any script counts as language: only these
characters are junk.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bert_core.errors import InputError

# Old Gutenberg files have a stray byte per page; random bytes decode to ~50 % junk.
MAX_JUNK_SHARE = 0.1
JUNK = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufffd\ue000-\uf8ff]")


@dataclass
class JunkMeter:
    """Counts the junk characters of one file, line by line; `check` raises when too many."""

    path: str | os.PathLike
    chars: int = 0
    junk: int = 0
    first_line: int | None = None

    def add(self, text: str, line: int) -> None:
        found = len(JUNK.findall(text))
        if found and self.first_line is None:
            self.first_line = line
        self.junk += found
        self.chars += len(text)

    def check(self) -> None:
        if self.chars and self.junk / self.chars > MAX_JUNK_SHARE:
            raise InputError(
                self.path,
                f"does not look like text: {self.junk / self.chars:.0%} of its {self.chars} "
                "characters are control characters, private-use characters or invalid UTF-8 "
                "(U+FFFD); is it a binary file, or in another encoding?",
                line=self.first_line,
            )
