"""Download the CIFAR python archives from their canonical URLs with urllib (no TensorFlow).

The archive goes to ``<directory>/<name>.part`` first, which a later attempt continues with an
HTTP Range request; once its MD5 matches the published one it is renamed to ``<directory>/<name>``,
where ``train.data`` finds it next time. ``$BSR_JAX_CIFAR_MIRROR`` replaces the base URL (a mirror
serving the same files; the MD5 is still checked).
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request

from train import progress
from train.data_sources import DataError

BASE_URL = "https://www.cs.toronto.edu/~kriz/"
MIRROR_VAR = "BSR_JAX_CIFAR_MIRROR"
# dataset -> (label, archive, MD5): the checksums torchvision and tensorflow-datasets check too.
CIFAR_ARCHIVES = {
    "cifar10": ("CIFAR-10", "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    "cifar100": ("CIFAR-100", "cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
}
_CHUNK = 1 << 20
_RANGE_NOT_SATISFIABLE = 416  # the .part file already holds the whole archive


class DownloadError(DataError):
    """The archive could not be downloaded or failed its checksum; the message starts with
    ``could not download <label> from <url>: <reason>``."""


def archive_url(dataset: str) -> str:
    return (os.environ.get(MIRROR_VAR) or BASE_URL).rstrip("/") + "/" + CIFAR_ARCHIVES[dataset][1]


def download_cifar(dataset: str, directory: str, timeout_s: float = 30.0) -> str:
    """Download ``dataset``'s python archive into ``directory`` (see module docstring); returns its path.

    Raises:
      DownloadError: no connection, an HTTP error, or a checksum mismatch (the bad file is removed).
    """
    label, name, md5 = CIFAR_ARCHIVES[dataset]
    url, path = archive_url(dataset), os.path.join(directory, name)
    part = path + ".part"
    os.makedirs(directory, exist_ok=True)
    offset = os.path.getsize(part) if os.path.exists(part) else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if response.status != 206:  # the whole file (a server may ignore the range)
                offset = 0
            length = int(response.headers.get("Content-Length") or 0)
            with open(part, "ab" if offset else "wb") as f, progress.bar(
                total=offset + length or None, initial=offset, unit="B", unit_scale=True, desc=f"downloading {name}"
            ) as bar:  # fmt: skip
                while chunk := response.read(_CHUNK):
                    f.write(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as error:
        if not (offset and error.code == _RANGE_NOT_SATISFIABLE):
            raise DownloadError(f"could not download {label} from {url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:  # no network, refused, timed out, reset
        reason = getattr(error, "reason", None) or error
        raise DownloadError(f"could not download {label} from {url}: {reason}") from None
    digest = _md5(part)
    if digest != md5:
        os.remove(part)
        raise DownloadError(f"could not download {label} from {url}: its MD5 is {digest}, not the published {md5} "
                            f"(removed {part}; try again)")  # fmt: skip
    os.replace(part, path)
    return path


def _md5(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
