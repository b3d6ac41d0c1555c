"""Prove that a change to the kernel headers leaves the machine code alone.

    python3 tests/sass_identity.py --base REV [-j N] [--only SUBSTRING] [--keep DIR]
    python3 tests/sass_identity.py --base-dir DIR ...   (DIR holds REV's generated/ and templates/include/)

Compares, for every module of the default manifest, the SASS of each translation unit compiled from
`generated/` and `templates/include/` of git revision REV (the "before") with the SASS compiled from
this checkout's (the "after"; run `attnforge generate` first if templates changed). Each unit is
compiled with the flags the runtime builds with (`-cubin` per arch of the module), disassembled with
cuobjdump, and normalized: addresses, instruction encodings and the module's uri hash are dropped,
and functions are compared as a set (their order in the cubin may follow the header order). Exits
0 when every module is identical, 1 otherwise, naming each differing function and its first
differing instruction. Needs nvcc and cuobjdump (the `nvidia-cuda-cuobjdump` wheel of the test
extras, or the CUDA toolkit); the default manifest takes ~4 minutes of compilation on 16 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attnforge.build import FA3_FLAGS, NVCC_FLAGS, cutlass_include
from attnforge.settings import settings

REPO = Path(__file__).resolve().parents[1]
# "/*0a40*/  IMAD R1, ... ;  /* 0x... */": keep the instruction text only.
_ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")
_URI_HASH = re.compile(r"_[0-9a-f]{10}(?=\b|_)")


@dataclass(frozen=True)
class Unit:
    """One translation unit of one module on one side, compiled for one arch."""

    module: str  # the uri without its hash: the same module on both sides
    source: Path
    include: Path
    arch: str  # e.g. "90a"

    @property
    def name(self) -> str:
        return f"{self.module}/{self.source.name} sm_{self.arch}"


def checkout(rev: str, into: Path) -> Path:
    """generated/ and templates/include/ of `rev`, extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "generated", "templates/include"],
                             check=True, capture_output=True).stdout
    into.mkdir(parents=True)
    archive_path = into / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="data")
    archive_path.unlink()
    return into


def units_of(root: Path, only: str | None) -> dict[str, Unit]:
    """Every .cu of every module under root/generated, keyed by module (hashless uri), file and arch."""
    units = {}
    for meta_path in sorted((root / "generated").glob("*/metadata.json")):
        meta = json.loads(meta_path.read_text())
        module = _URI_HASH.sub("", meta["uri"])
        if only and only not in module:
            continue
        for source in sorted(meta_path.parent.glob("*.cu")):
            for arch in meta["spec"]["archs"]:
                unit = Unit(module, source, root / "templates" / "include", arch.removeprefix("SM").lower())
                units[unit.name] = unit
    return units


def sass_of(unit: Unit, out_dir: Path) -> dict[str, list[str]]:
    """The unit's normalized SASS, function name -> instructions."""
    cubin = out_dir / (unit.name.replace("/", "__").replace(" ", "_") + ".cubin")
    flags = [*NVCC_FLAGS, f"-arch=sm_{unit.arch}", f"-I{unit.source.parent}", f"-I{unit.include}"]
    if "_fa3_" in unit.module:
        flags += [*FA3_FLAGS, f"-I{cutlass_include(settings())}"]
    nvcc = settings().nvcc or "nvcc"
    built = subprocess.run([str(nvcc), *flags, "-cubin", str(unit.source), "-o", str(cubin)], capture_output=True,
                           text=True)
    if built.returncode != 0:
        errors = [line for line in built.stderr.splitlines() if not line.startswith("ptxas info")]
        raise RuntimeError(f"nvcc failed for {unit.name} ({unit.source}):\n" + "\n".join(errors[-20:]))
    listing = subprocess.run([cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        if line.strip().startswith("Function :"):
            current = functions.setdefault(line.split(":", 1)[1].strip(), [])
            continue
        text = _URI_HASH.sub("", _ENCODING.sub("", _ADDRESS.sub("", line))).strip()
        if text and not text.startswith(("code for", "Fatbin", "....", "arch =", "host =", "compile_size", "identifier")):
            current.append(text)
    return functions


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        from nvidia.cu13 import bin as cuda_bin  # the nvidia-cuda-cuobjdump wheel
        return str(Path(cuda_bin.__path__[0]) / "cuobjdump")
    except ImportError:
        raise SystemExit("sass_identity: cuobjdump not found (pip install nvidia-cuda-cuobjdump, or add the CUDA "
                         "toolkit's bin to PATH)") from None


def first_difference(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    problems = [f"function only before: {name}" for name in sorted(before.keys() - after.keys())]
    problems += [f"function only after: {name}" for name in sorted(after.keys() - before.keys())]
    for name in sorted(before.keys() & after.keys()):
        a, b = before[name], after[name]
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"{name}: {len(a)} vs {len(b)} instructions, first difference at {i}: "
                            f"{a[i] if i < len(a) else '<end>'!r} vs {b[i] if i < len(b) else '<end>'!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="git revision whose machine code is the reference")
    base.add_argument("--base-dir", type=Path, help="a folder holding the reference's generated/ and templates/include/")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    parser.add_argument("--only", help="only modules whose uri contains this")
    parser.add_argument("--keep", type=Path, help="keep the cubins here (default: a temporary folder)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        before = units_of(args.base_dir or checkout(args.base, work / "before"), args.only)
        after = units_of(REPO, args.only)
        if before.keys() != after.keys():
            print("units differ:", sorted(before.keys() ^ after.keys()))
            return 1
        (work / "cubin" / "before").mkdir(parents=True, exist_ok=True)
        (work / "cubin" / "after").mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            sass_before = {n: pool.submit(sass_of, u, work / "cubin" / "before") for n, u in before.items()}
            sass_after = {n: pool.submit(sass_of, u, work / "cubin" / "after") for n, u in after.items()}
            failed = 0
            for name in sorted(before):
                problems = first_difference(sass_before[name].result(), sass_after[name].result())
                functions = len(sass_after[name].result())
                print(f"{'identical' if not problems else 'DIFFERENT'}  {name}  ({functions} functions)")
                for problem in problems:
                    print(f"    {problem}")
                failed += bool(problems)
    print(f"sass_identity: {len(before) - failed} of {len(before)} units identical to {args.base or args.base_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
