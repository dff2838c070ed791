"""Rebuild the lab's corpus from the Debian package ``r-cran-janeaustenr`` (run once; the result is committed).

Usage (on a Debian machine)::

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python -m labsrc.data.build_corpus pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb

The package stores each novel as an R character vector (one element per printed line) in R's lazy-load
database. We read those vectors with a tiny parser of R's XDR serialization (no R needed), join the wrapped
lines of each paragraph, and split every novel at a fixed point: its last 5% of paragraphs are validation.
No code of the package is copied; only the novels' text, which is in the public domain, is kept.
"""
from __future__ import annotations

import lzma
import struct
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALIDATION_FRACTION = 0.05


def _chunks(rdb: bytes):
    """Yield the decompressed objects of an R lazy-load database (4-byte length, then a zlib stream)."""
    i = 0
    while i < len(rdb):
        inflater = zlib.decompressobj()
        body = inflater.decompress(rdb[i + 4:])
        i += 4 + len(rdb[i + 4:]) - len(inflater.unused_data)
        yield body


def _strings(obj: bytes) -> list[str]:
    """Parse one XDR-serialized R character vector (STRSXP) into a list of Python strings."""
    if obj[:2] != b"X\n":
        raise ValueError("not an XDR serialization")
    pos = 2 + 12  # format version, writer and reader versions
    (nenc,) = struct.unpack(">i", obj[pos:pos + 4])
    pos += 4 + nenc  # native encoding name (serialization version 3)
    flags, n = struct.unpack(">ii", obj[pos:pos + 8])
    if flags & 0xFF != 16:
        raise ValueError(f"expected a character vector, got SEXP type {flags & 0xFF}")
    pos += 8
    out = []
    for _ in range(n):
        _, length = struct.unpack(">ii", obj[pos:pos + 8])
        pos += 8
        if length == -1:
            out.append("")
            continue
        out.append(obj[pos:pos + length].decode("utf-8"))
        pos += length
    return out


def paragraphs(lines: list[str]) -> list[str]:
    """Join wrapped printed lines into paragraphs (blank lines separate paragraphs)."""
    paras, cur = [], []
    for line in lines + [""]:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur).replace("_", ""))  # underscores mark italics in the e-texts
            cur = []
    return paras


def build(rdb_path: str) -> None:
    train, val = [], []
    for obj in _chunks(Path(rdb_path).read_bytes()):
        paras = paragraphs(_strings(obj))
        cut = int(len(paras) * (1 - VALIDATION_FRACTION))
        train.extend(paras[:cut])
        val.extend(paras[cut:])
    for name, paras in (("train", train), ("validation", val)):
        text = "\n\n".join(paras) + "\n"
        with lzma.open(HERE / f"austen_{name}.txt.xz", "wt", encoding="utf-8", preset=9) as f:
            f.write(text)
        print(f"{name}: {len(paras)} paragraphs, {len(text):,} characters")


if __name__ == "__main__":
    build(sys.argv[1])
