"""Fetch the real Wikipedia sample dumps that ship inside the gensim 4.4.0 wheel (through pip, from PyPI).

The wheel is only downloaded and opened as a zip: gensim itself is never installed or imported.
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

GENSIM_WHEEL_SPEC = "gensim==4.4.0"
SAMPLE_FILES = (
    "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",  # 206 pages, 106 articles
    "enwiki-table-markup.xml.bz2",  # 5 pages heavy with tables
    "bgwiki-latest-pages-articles-shortened.xml.bz2",  # UTF-16LE + CRLF: the reader decodes it (expat follows the BOM)
)
DEFAULT_DEST = Path("data/sample")


def fetch_sample(dest: Path = DEFAULT_DEST, download_dir: Path | None = None) -> dict[str, Path]:
    """Make sure the sample dumps exist under `dest`; returns {file name: path}. Idempotent and offline once done."""
    dest = Path(dest)
    wanted = {name: dest / name for name in SAMPLE_FILES}
    if all(p.is_file() for p in wanted.values()):
        return wanted
    download_dir = Path(download_dir or dest.parent / "downloads")
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(download_dir.glob("gensim-4.4.0-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", GENSIM_WHEEL_SPEC,
               "-d", str(download_dir), "--quiet"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {GENSIM_WHEEL_SPEC} from the package index:\n{proc.stderr[-2000:]}")
        wheels = sorted(download_dir.glob("gensim-4.4.0-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip downloaded no gensim 4.4.0 wheel into {download_dir}")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = {Path(n).name: n for n in wheel.namelist() if "/test_data/" in n}
        for name, path in wanted.items():
            if path.is_file():
                continue
            if name not in members:
                raise RuntimeError(f"{wheels[0].name} has no test_data/{name}")
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(wheel.read(members[name]))
            tmp.rename(path)
    return wanted


def main() -> None:
    for name, path in fetch_sample().items():
        print(f"{path}  ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
