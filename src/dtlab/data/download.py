"""Downloads with checksum verification, written atomically (`.part` file, then rename)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tarfile
import urllib.request
from pathlib import Path

from dtlab import files
from dtlab.errors import DataError


def md5sum(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, md5: str, timeout_s: float = 60.0) -> Path:
    """Fetch `url` to `dest` unless a file with the right checksum is already there."""
    dest = Path(dest)
    if dest.is_file() and md5sum(dest) == md5:
        return dest
    part = dest.with_name(dest.name + ".part")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        if e.errno in files.WRITE_FAILURES:  # the disk, not the network
            raise DataError(files.describe(e, f"downloading {url} to '{dest}'", "data.dir")) from None
        raise DataError(
            f"cannot download {url}: {e}; fix: check the network, or place the file at {dest}"
        ) from None
    got = md5sum(part)
    if got != md5:
        part.unlink(missing_ok=True)
        raise DataError(
            f"checksum mismatch for {url}: md5 {got}, expected {md5}; the download is corrupt, "
            "fix: retry, or place a verified copy at " + str(dest)
        )
    part.replace(dest)
    return dest


def extract_tar(archive: Path, dest_dir: Path) -> None:
    """Extract a tar archive; the `data` filter refuses absolute paths, links out and devices."""
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest_dir, filter="data")
    except OSError as e:
        if e.errno in files.WRITE_FAILURES:
            raise DataError(files.describe(e, f"extracting {archive} into '{dest_dir}'",
                                           "data.dir")) from None
        raise DataError(f"cannot extract {archive}: {e}; fix: delete it and download again") from None
    except tarfile.TarError as e:
        raise DataError(f"cannot extract {archive}: {e}; fix: delete it and download again") from None
