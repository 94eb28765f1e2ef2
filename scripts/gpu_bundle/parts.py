"""Pack a folder into a split archive with a manifest, and verify + unpack it on the target.

Standard library only: this file travels inside the bundle (beside the last part) and runs on the GPU
machine with whatever Python is there.

Layout written by `pack`: OUT/p0/part.0, OUT/p1/part.1, ..., one part per subfolder, and the manifest
(sha256 and size of every part, in order) in the last part's subfolder, so that copying the parts one
subfolder at a time, last one last, brings the unpack side along with the last part. `unpack` also finds
the parts when they were all copied into one folder.

    python3 parts.py unpack PARTS_DIR DEST [--manifest FILE]   # verify, unpack, print `export` lines
    python3 parts.py pack SRC OUT [--part-size 50M] [--compression gz|xz|none]   # any folder (e.g. wheels)
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

MANIFEST = "manifest.json"
COMPRESSIONS = ("gz", "xz", "none")
# A device call carries the repository's working tree and one part within 64 MiB: 50 MiB leaves the tree ~13 MiB
# (tests/test_gpu_bundle.py checks the two still fit).
DEFAULT_PART_SIZE = "50M"
STAMP = ".gpu-bundle-id"  # in DEST: the archive digest it was unpacked from
_CHUNK = 1 << 20
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class BundleError(RuntimeError):
    """The bundle cannot be unpacked as it is (a part missing or corrupt, a foreign DEST, a wrong Python)."""


def parse_size(text: str) -> int:
    """'50M', '50MiB', '4k', '1048576' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text.lower())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"not a size: {text!r} (e.g. 50M)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


class _PartWriter:
    """A write-only stream that rolls over into OUT/pI/part.I every `part_size` bytes."""

    def __init__(self, out_dir: Path, part_size: int):
        self.out_dir, self.part_size = out_dir, part_size
        self.parts: list[dict] = []
        self.archive = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._digest = hashlib.sha256()
        self._left = 0

    def _open_next(self) -> None:
        self._close_current()
        index = len(self.parts)
        folder = self.out_dir / f"p{index}"
        folder.mkdir(parents=True, exist_ok=True)
        self.parts.append({"name": f"part.{index}", "dir": folder.name, "bytes": 0, "sha256": ""})
        self._file = open(folder / f"part.{index}", "wb")
        self._digest = hashlib.sha256()
        self._left = self.part_size

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._digest.hexdigest()
            self._file = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.archive.update(view)
        while view:
            if self._file is None or self._left == 0:
                self._open_next()
            piece = view[: self._left]
            self._file.write(piece)
            self._digest.update(piece)
            self.parts[-1]["bytes"] += len(piece)
            self._left -= len(piece)
            view = view[len(piece):]
        return len(data)

    def close(self) -> None:
        if not self.parts:  # an empty archive still has one (empty) part
            self._open_next()
        self._close_current()


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # The same tree gives the same archive whoever builds it.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_tar(src: Path, stream: BinaryIO, mode: str) -> None:
    with tarfile.open(fileobj=stream, mode=mode, format=tarfile.PAX_FORMAT) as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name, filter=_normalized)


def pack(src: Path, out_dir: Path, part_size: int, *, compression: str = "gz", threads: int = 0,
         meta: dict | None = None) -> dict:
    """Archive the contents of `src` (tar; gz, xz or none) into parts under `out_dir`; write and return the
    manifest. `meta` goes into the manifest as is (format, python, packages...). gz is the fast one: a bundle
    of mostly already-compressed CUDA libraries shrinks little more under xz, at ~20x the time on 2 cores."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("p[0-9]*"):
        if old.is_dir() and re.fullmatch(r"p\d+", old.name):
            shutil.rmtree(old)
    writer = _PartWriter(out_dir, part_size)
    if compression == "none":
        _write_tar(src, writer, "w|")
    elif compression == "gz" and (tool := shutil.which("pigz") or shutil.which("gzip")):
        _pipe_through([tool, "-c", "-1"], src, writer)
    elif compression == "gz":
        _write_tar(src, writer, "w|gz")
    elif shutil.which("xz"):
        # The xz tool compresses in blocks on all cores, which also lets the target decompress on all cores.
        _pipe_through(["xz", "-c", "-6", f"-T{threads}"], src, writer)
    else:
        _write_tar(src, writer, "w|xz")
    writer.close()
    manifest = {**(meta or {}), "compression": compression, "archive_sha256": writer.archive.hexdigest(),
                "archive_bytes": sum(p["bytes"] for p in writer.parts), "parts": writer.parts}
    (out_dir / writer.parts[-1]["dir"] / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _pipe_through(cmd: list[str], src: Path, writer: BinaryIO) -> None:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    reader = threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, writer, _CHUNK))
    reader.start()
    try:
        _write_tar(src, proc.stdin, "w|")
    finally:
        proc.stdin.close()
        reader.join()
    if proc.wait() != 0:
        raise BundleError(f"{cmd[0]} failed with exit status {proc.returncode}")


def find_part(parts_dir: Path, part: dict) -> Path | None:
    """The part in PARTS_DIR itself, in its own subfolder (pI/part.I), or in any one subfolder."""
    for candidate in (parts_dir / part["name"], parts_dir / part.get("dir", "") / part["name"]):
        if candidate.is_file():
            return candidate
    return next((p for p in sorted(parts_dir.glob(f"*/{part['name']}")) if p.is_file()), None)


def verify(parts_dir: Path, manifest: dict) -> list[Path]:
    """Every part present with the size and sha256 the manifest lists, in order; else BundleError naming it."""
    found = []
    for part in manifest["parts"]:
        path = find_part(parts_dir, part)
        if path is None:
            raise BundleError(f"{part['name']} is missing: not in {parts_dir} nor in a subfolder of it "
                              f"({len(manifest['parts'])} parts expected)")
        size = path.stat().st_size
        if size != part["bytes"]:
            raise BundleError(f"{part['name']} ({path}) is {size} bytes, the manifest says {part['bytes']}: "
                              "an incomplete copy; copy it again")
        digest = sha256_file(path)
        if digest != part["sha256"]:
            raise BundleError(f"{part['name']} ({path}) is corrupt: sha256 {digest[:16]}... differs from the "
                              f"manifest's {part['sha256'][:16]}...; copy it again")
        found.append(path)
    return found


def _chunks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                yield block


class _Concat:
    """The parts read back to back, as one read-only stream."""

    def __init__(self, paths: list[Path]):
        self._chunks = _chunks(paths)
        self._block, self._pos = b"", 0

    def read(self, size: int = -1) -> bytes:
        pieces = []
        while size != 0:
            if self._pos >= len(self._block):
                block = next(self._chunks, None)
                if block is None:
                    break
                self._block, self._pos = block, 0
            available = len(self._block) - self._pos
            take = available if size < 0 else min(size, available)
            pieces.append(self._block[self._pos:self._pos + take])
            self._pos += take
            if size > 0:
                size -= take
        return b"".join(pieces)


def _extract_with_tools(paths: list[Path], compression: str, dest: Path) -> None:
    tar = subprocess.Popen(["tar", "-x", "-f", "-", "-C", str(dest)], stdin=subprocess.PIPE)
    xz = None
    if compression in ("xz", "gz"):
        cmd = ["xz", "-dc", "-T0"] if compression == "xz" else [shutil.which("pigz") or "gzip", "-dc"]
        xz = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=tar.stdin)
        tar.stdin.close()  # tar reads xz's output; only xz holds the pipe now
    sink = xz.stdin if xz else tar.stdin
    try:
        for block in _chunks(paths):
            sink.write(block)
    except BrokenPipeError:
        pass  # the reader failed: its exit status says why
    finally:
        sink.close()
    statuses = [("xz", xz.wait()) if xz else ("xz", 0), ("tar", tar.wait())]
    for tool, status in statuses:
        if status != 0:
            raise BundleError(f"{tool} failed (exit status {status}) while unpacking into {dest}")


def _extract_in_python(paths: list[Path], compression: str, dest: Path) -> None:
    stream: BinaryIO = _Concat(paths)  # type: ignore[assignment]
    if compression == "xz":
        stream = lzma.LZMAFile(stream)  # type: ignore[arg-type]
    elif compression == "gz":
        stream = gzip.GzipFile(fileobj=stream)  # type: ignore[arg-type]
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)


def unpack(parts_dir: Path, dest: Path, manifest_path: Path | None = None, *, use_tools: bool = True) -> dict:
    """Verify the parts, then unpack into `dest` (skipped when `dest` already holds this very archive).
    A `dest` that holds an earlier bundle is replaced; any other non-empty `dest` is refused."""
    parts_dir = Path(parts_dir)
    manifest_path = manifest_path or _find_manifest(parts_dir)
    manifest = json.loads(Path(manifest_path).read_text())
    _check_python(manifest)
    stamp = dest / STAMP
    if stamp.is_file() and stamp.read_text().strip() == manifest["archive_sha256"]:
        return manifest
    if dest.exists() and any(dest.iterdir()) and not stamp.is_file():
        raise BundleError(f"{dest} exists and is not an unpacked bundle; choose another DEST or empty it")
    paths = verify(parts_dir, manifest)
    staging = dest.with_name(dest.name + ".unpacking")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tool = {"none": "tar", "xz": "xz", "gz": "gzip"}[manifest["compression"]]
        if use_tools and shutil.which("tar") and shutil.which(tool):
            _extract_with_tools(paths, manifest["compression"], staging)
        else:
            _extract_in_python(paths, manifest["compression"], staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (staging / STAMP).write_text(manifest["archive_sha256"] + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    return manifest


def _find_manifest(parts_dir: Path) -> Path:
    candidates = [parts_dir / MANIFEST, *sorted(parts_dir.glob(f"*/{MANIFEST}"))]
    found = [c for c in candidates if c.is_file()]
    if not found:
        raise BundleError(f"no {MANIFEST} in {parts_dir} or its subfolders: it comes with the last part")
    return found[0]


def _check_python(manifest: dict) -> None:
    wanted = manifest.get("python")
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # A site-packages folder holds compiled extensions for one Python; a wheelhouse is checked by pip.
    if manifest.get("format") == "site" and wanted and wanted != here:
        raise BundleError(f"this bundle was built for Python {wanted}, and {sys.executable} is {here}")


def _install_wheels(dest: Path) -> None:
    # --no-deps: the bundle leaves out what the target has and the optional packages it chose to leave
    # out, so pip must not go looking for them.
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(dest / "wheels"),
           "-r", str(dest / "requirements.txt")]
    print("gpu bundle: " + " ".join(cmd), file=sys.stderr)
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
        raise BundleError("pip could not install the wheelhouse (its output is above)")


def environment(manifest: dict, dest: Path) -> dict[str, str]:
    """The variables the stack needs on the target, without overriding any the caller set."""
    env: dict[str, str] = {}
    if manifest.get("format") == "site":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(dest), os.environ.get("PYTHONPATH")]))
        env["PATH"] = os.pathsep.join(filter(None, [str(dest / "bin"), os.environ.get("PATH")]))
    defaults = dict(manifest.get("env", {}))
    if not (dest / "flashinfer").is_dir() and not _importable("flashinfer"):
        # vLLM's default sampler on CUDA is FlashInfer's; without FlashInfer, use vLLM's own.
        defaults["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env.update({key: value for key, value in defaults.items() if key not in os.environ})
    return env


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("unpack", help="verify the parts, unpack, print the `export` lines to eval")
    cmd.add_argument("parts_dir", type=Path)
    cmd.add_argument("dest", type=Path)
    cmd.add_argument("--manifest", type=Path, default=None)
    pack_cmd = sub.add_parser("pack", help="pack a folder into parts with a manifest (a file set, not a bundle)")
    pack_cmd.add_argument("src", type=Path)
    pack_cmd.add_argument("out", type=Path)
    pack_cmd.add_argument("--part-size", default=DEFAULT_PART_SIZE)
    pack_cmd.add_argument("--compression", choices=COMPRESSIONS, default="gz")
    args = parser.parse_args(argv)
    if args.command == "pack":
        manifest = pack(args.src, args.out, parse_size(args.part_size), compression=args.compression,
                        meta={"format": "files"})
        print(f"{len(manifest['parts'])} parts, {manifest['archive_bytes'] / 2**20:.1f} MiB in {args.out}")
        return 0
    try:
        manifest = unpack(args.parts_dir, args.dest.absolute(), args.manifest)
        if manifest.get("format") == "wheels":
            _install_wheels(args.dest.absolute())
    except (BundleError, OSError, json.JSONDecodeError) as e:
        print(f"gpu bundle: {e}", file=sys.stderr)
        return 1
    for key, value in environment(manifest, args.dest.absolute()).items():
        print(f"export {key}={_shell_quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
