"""CIFAR download against a local HTTP server (127.0.0.1 only): a small archive in the real
cifar-10-python format, a partial download continued with a Range request, a corrupt download, and
a server that refuses connections (no network)."""

from __future__ import annotations

import hashlib
import http.server
import socket
import threading

import numpy as np
import pytest

from train import data, download

NAME = "cifar-10-python.tar.gz"


class ArchiveServer:
    """Serves ``files`` (path -> bytes) on 127.0.0.1, honouring ``Range: bytes=N-``; records the
    Range header of every request."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.ranges = files, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = server.files.get(self.path.lstrip("/"))
                if body is None:
                    self.send_error(404)
                    return
                requested = self.headers.get("Range")
                server.ranges.append(requested)
                start = int(requested.removeprefix("bytes=").rstrip("-")) if requested else 0
                self.send_response(206 if requested else 200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

            def log_message(self, *args):  # keep pytest's output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def cifar_archive(isolated_env, fake_data, monkeypatch):
    """A small cifar-10-python.tar.gz (train 10 and test 5 images) with its MD5 as the published one."""
    rng = np.random.default_rng(0)
    train, test = fake_data.random_split(rng, 10, 10, size=32), fake_data.random_split(rng, 5, 10, size=32)
    source = isolated_env / "source"
    source.mkdir()
    content = open(fake_data.write_cifar_python(str(source), "cifar10", train, test, archive=True), "rb").read()
    label, name, _ = download.CIFAR_ARCHIVES["cifar10"]
    monkeypatch.setitem(download.CIFAR_ARCHIVES, "cifar10", (label, name, hashlib.md5(content).hexdigest()))
    return content, train, test


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"  # nothing listens there: connection refused


def test_download_verify_store_and_find_it_next_time(isolated_env, cifar_archive, monkeypatch):
    content, train, test = cifar_archive
    cache = isolated_env / "cache"
    with ArchiveServer({NAME: content}) as server:
        monkeypatch.setenv(download.MIRROR_VAR, server.url)
        loaded = data.load_split("cifar10", "train", cache_dir=str(cache))
        np.testing.assert_array_equal(loaded.images, train.images)
        np.testing.assert_array_equal(data.load_split("cifar10", "test", cache_dir=str(cache)).labels, test.labels)
    assert server.ranges == [None]  # one whole download; the test split came from the stored archive
    assert (cache / "downloads" / NAME).read_bytes() == content
    assert not (cache / "downloads" / f"{NAME}.part").exists()


def test_partial_download_is_continued_with_a_range_request(isolated_env, cifar_archive, monkeypatch):
    content, _, _ = cifar_archive
    downloads = isolated_env / "downloads"
    downloads.mkdir()
    (downloads / f"{NAME}.part").write_bytes(content[:1000])
    with ArchiveServer({NAME: content}) as server:
        monkeypatch.setenv(download.MIRROR_VAR, server.url)
        path = download.download_cifar("cifar10", str(downloads))
    assert server.ranges == ["bytes=1000-"]
    assert open(path, "rb").read() == content


def test_corrupt_download_is_rejected_and_removed(isolated_env, cifar_archive, monkeypatch):
    content, _, _ = cifar_archive
    corrupt = content[:-10] + bytes(10)
    cache = isolated_env / "cache"
    with ArchiveServer({NAME: corrupt}) as server:
        monkeypatch.setenv(download.MIRROR_VAR, server.url)
        with pytest.raises(data.DataError) as info:
            data.load_split("cifar10", "train", cache_dir=str(cache))
    message = str(info.value)
    cause, _, remedy = message.splitlines()
    assert cause.startswith(f"could not download CIFAR-10 from {server.url}{NAME}: its MD5 is ") and "--data-dir" in remedy
    assert sorted(p.name for p in (cache / "downloads").iterdir()) == []  # nothing half-trusted is kept


def test_no_network_is_the_cause_then_how_to_pass_data_dir(isolated_env, monkeypatch):
    url = _closed_port_url()
    monkeypatch.setenv(download.MIRROR_VAR, url)
    with pytest.raises(data.DataError) as info:
        data.load_split("cifar10", "train", cache_dir=str(isolated_env / "cache"))
    message = str(info.value)
    assert message.startswith(f"could not download CIFAR-10 from {url}{NAME}: ")
    cause, looked, remedy = message.splitlines()
    assert "refused" in cause.lower() and "--data-dir" in remedy and "image folder" in remedy
    # Where it looked before downloading: tfds' manual dir, then the download directory.
    manual, downloads = isolated_env / "tfds" / "downloads" / "manual", isolated_env / "cache" / "downloads"
    assert looked == f"  Looked in {manual} (does not exist), {downloads} (does not exist) first."
    assert remedy == f"  Offline: pass --data-dir {NAME} from elsewhere, or an image folder; or set ${download.MIRROR_VAR}."
    with pytest.raises(data.DataNotFoundError):  # with --data-dir nothing is downloaded
        data.load_split("cifar10", "train", data_dir=str(isolated_env), cache_dir=str(isolated_env / "cache"))
