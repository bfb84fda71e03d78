"""What a data file that is not UTF-8 text is, said in its error: a compressed file or an archive by its
first bytes, a binary one by its control bytes, else text of another encoding with the iconv line that
converts it (a gzip file without `.gz` was told to convert from WINDOWS-1252)."""

from __future__ import annotations

import re

PACKED = ((b"\x1f\x8b", "gzip-compressed: name the file *.gz"), (b"(\xb5/\xfd", "zstd-compressed: zstd -d it"),
          (b"BZh", "bzip2-compressed: bunzip2 it"), (b"\xfd7zXZ\x00", "xz-compressed: unxz it"),
          (b"PK\x03\x04", "a zip archive: unzip it"), (b"PAR1", "a parquet file: name it *.parquet"),
          (b"ARROW1", "an arrow file: name it *.arrow"),
          (b"\xff\xfe", "UTF-16 text: convert it, iconv -f UTF-16 -t UTF-8"),
          (b"\xfe\xff", "UTF-16 text: convert it, iconv -f UTF-16 -t UTF-8"))  # (the first bytes of each)
CONTROLS = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # (no text of an 8-bit encoding holds these)


def convert_hint(error: UnicodeDecodeError) -> str:
    """What the bytes that failed are (PACKED, control bytes), else iconv advice naming a likely encoding:
    GB18030 where bytes above ASCII come in runs of two characters or more (Chinese), else Windows-1252
    (Western European: an ü or a "çõ" between ASCII letters, which GB18030 would read as Chinese
    characters: garbled). From the first bad byte on: UTF-8 text before a stray line is no evidence
    either way."""
    head = bytes(error.object[:8])
    packed = next((what for magic, what in PACKED if head.startswith(magic)), None)
    if error.start < 8 and packed:
        return f": its bytes are {packed}"
    sample = bytes(error.object[error.start : error.start + 512])
    if b"\x00" in sample or 20 * len(CONTROLS.findall(sample)) >= len(sample):
        return ": its bytes are binary (control bytes no text holds), not text of any encoding"
    sample = sample[:64]
    longest = max(len(run) for run in re.split(rb"[\x00-\x7f]+", sample))
    guess = "GB18030" if longest >= 4 else "WINDOWS-1252"
    return f": convert it, e.g. iconv -f {guess} -t UTF-8 (or the encoding it was written in)"
