"""Moves the per-run diagnostics of stored results into sidecars (bench/result_files.py): every
JSON under the results folder whose ``sweep`` rows carry ``ROW_DETAIL`` keys or which holds a
``policy_timeline`` becomes its slim main JSON (indented or compact as the file is now) and its
``<stem>.detail.json.gz``. Every pair is first written to a scratch folder and read back with
``load_result``; unless each one equals its original, nothing in the results folder is written.
A file that was read-only stays read-only (its sidecar too). Run it again: nothing left to do.

    python bench/tools/split_result_details.py [--dry-run] [ROOT]  (default: bench/results)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import RESULTS_ROOT  # noqa: E402
from result_files import detail_path, load_result, split_details, write_result  # noqa: E402

Pending = tuple[Path, dict[str, Any], bool]  # a file, its report, whether it is compact


def pending(root: Path) -> list[Pending]:
    """The JSONs under ``root`` with details to move, as they are now."""
    found = []
    for path in sorted(root.rglob("*.json")):
        text = path.read_text()
        report = json.loads(text)
        if isinstance(report, dict) and split_details(report)[1]:
            found.append((path, report, not text.startswith("{\n")))
    return found


def stage(files: list[Pending], root: Path, scratch: Path) -> list[Path]:
    """Each file's pair under ``scratch`` (same relative path), read back; a mismatch exits."""
    staged = []
    for path, report, compact in files:
        copy = write_result(scratch / path.relative_to(root), report, compact)
        if load_result(copy) != report:
            sys.exit(f"{path}: the split does not read back equal; nothing was written")
        staged.append(copy)
    return staged


def install(files: list[Pending], staged: list[Path]) -> None:
    """The checked pairs in place of the originals, with the originals' permissions."""
    for (path, report, _), copy in zip(files, staged, strict=True):
        mode = path.stat().st_mode & 0o777
        path.chmod(mode | 0o200)
        shutil.copyfile(detail_path(copy), detail_path(path))
        shutil.copyfile(copy, path)
        for written in (path, detail_path(path)):
            written.chmod(mode)
        if load_result(path) != report:
            sys.exit(f"{path}: written but does not read back equal")


def pair_bytes(path: Path) -> int:
    return path.stat().st_size + detail_path(path).stat().st_size


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("root", nargs="?", default=str(RESULTS_ROOT), help="the results folder")
    p.add_argument("--dry-run", action="store_true", help="split and check; write nothing")
    args = p.parse_args(argv)
    root = Path(args.root)
    files = pending(root)
    before = sum(path.stat().st_size for path, _, _ in files)
    with tempfile.TemporaryDirectory() as scratch:
        staged = stage(files, root, Path(scratch))
        after = sum(pair_bytes(copy) for copy in staged)
        if not args.dry_run:
            install(files, staged)
    what = "would become" if args.dry_run else "became"
    print(f"{len(files)} files with details under {root}: {before / 1e6:.1f} MB {what} "
          f"{after / 1e6:.1f} MB (main JSONs and .detail.json.gz sidecars)")  # fmt: skip
    return [path for path, _, _ in files]


if __name__ == "__main__":
    main()
