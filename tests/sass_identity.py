"""Prove that a change to the kernel headers or to how a module is split into translation units
leaves the machine code alone.

    python3 tests/sass_identity.py --base REV [-j N] [--only SUBSTRING] [--keep DIR]
    python3 tests/sass_identity.py --base-dir DIR ...   (DIR holds REV's generated/, templates/include/
                                                         and, optionally, runtime/build.py)

Compares, for every module of the default manifest, the SASS compiled from `generated/` and
`templates/include/` of git revision REV (the "before") with the SASS compiled from this checkout's
(the "after"; run `attnforge generate` first if templates changed). Each unit is compiled with the
flags its side's runtime builds with (NVCC_FLAGS and FA3_FLAGS read from that side's
runtime/build.py; `-cubin` per arch of the module), disassembled with cuobjdump, and normalized:
addresses, instruction encodings and the module's uri hash are dropped, and functions are compared
as a set (their order in the cubin may follow the header order). Where a module has the same units
on both sides, each unit is compared with its namesake; where its units were re-partitioned, the
union of its units' functions is compared (a function compiled in two units of one side must be the
same in both). Exits 0 when every module is identical, 1 otherwise, naming each differing function
and its first differing instruction. Needs nvcc and cuobjdump (the `nvidia-cuda-cuobjdump` wheel of
the test extras, or the CUDA toolkit); the default manifest takes ~4 minutes of compilation on 16
cores.
"""

from __future__ import annotations

import argparse
import ast
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

from attnforge.build import cutlass_include
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
    flags: tuple[str, ...]  # the side's NVCC_FLAGS, and FA3_FLAGS for an fa3 module

    @property
    def name(self) -> str:
        return f"{self.module}/{self.source.name} sm_{self.arch}"

    @property
    def group(self) -> str:
        """The module and arch whose units are compared as one set where they were re-partitioned."""
        return f"{self.module} sm_{self.arch}"


def checkout(rev: str, into: Path) -> Path:
    """generated/, templates/include/ and runtime/build.py of `rev`, extracted under `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "generated", "templates/include",
                              "runtime/build.py"], check=True, capture_output=True).stdout
    into.mkdir(parents=True)
    archive_path = into / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="data")
    archive_path.unlink()
    return into


def build_flags(root: Path) -> dict[str, tuple[str, ...]]:
    """NVCC_FLAGS and FA3_FLAGS as root/runtime/build.py sets them (this checkout's where there is none),
    so each side compiles with the flags its runtime built with."""
    path = root / "runtime" / "build.py"
    tree = ast.parse((path if path.is_file() else REPO / "runtime" / "build.py").read_text())
    flags = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("NVCC_FLAGS", "FA3_FLAGS"):
                flags[node.targets[0].id] = tuple(ast.literal_eval(node.value))
    if flags.keys() != {"NVCC_FLAGS", "FA3_FLAGS"}:
        raise SystemExit(f"sass_identity: {path} does not set NVCC_FLAGS and FA3_FLAGS as literal tuples")
    return flags


def units_of(root: Path, only: str | None) -> dict[str, Unit]:
    """Every .cu of every module under root/generated, keyed by module (hashless uri), file and arch."""
    flags = build_flags(root)
    units = {}
    for meta_path in sorted((root / "generated").glob("*/metadata.json")):
        meta = json.loads(meta_path.read_text())
        module = _URI_HASH.sub("", meta["uri"])
        if only and only not in module:
            continue
        unit_flags = flags["NVCC_FLAGS"] + (flags["FA3_FLAGS"] if "_fa3_" in module else ())
        for source in sorted(meta_path.parent.glob("*.cu")):
            for arch in meta["spec"]["archs"]:
                unit = Unit(module, source, root / "templates" / "include", arch.removeprefix("SM").lower(),
                            unit_flags)
                units[unit.name] = unit
    return units


def sass_of(unit: Unit, out_dir: Path) -> dict[str, list[str]]:
    """The unit's normalized SASS, function name -> instructions."""
    cubin = out_dir / (unit.name.replace("/", "__").replace(" ", "_") + ".cubin")
    flags = [*unit.flags, f"-arch=sm_{unit.arch}", f"-I{unit.source.parent}", f"-I{unit.include}"]
    if "_fa3_" in unit.module:
        flags.append(f"-I{cutlass_include(settings())}")
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


def union_of(names: list[str], sass: dict[str, dict[str, list[str]]]) -> tuple[dict[str, list[str]], list[str]]:
    """The functions of the named units together, and each function two of them compile differently."""
    union: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    problems = []
    for name in names:
        for function, code in sass[name].items():
            if function in union and union[function] != code:
                problems.append(f"{function}: differs between {where[function]} and {name} of one side")
            union.setdefault(function, code)
            where.setdefault(function, name)
    return union, problems


def compare_group(group: str, before: list[str], after: list[str], sass_before: dict, sass_after: dict
                  ) -> list[tuple[str, list[str], int]]:
    """(label, problems, functions) per comparison of one module and arch: per unit where both sides
    have the same units, else the union of the units' functions."""
    if [unit_file(n) for n in before] == [unit_file(n) for n in after]:
        return [(name, first_difference(sass_before[name], sass_after[name]), len(sass_after[name]))
                for name in before]
    union_before, problems_before = union_of(before, sass_before)
    union_after, problems_after = union_of(after, sass_after)
    label = f"{group} (units {', '.join(map(unit_file, before))} -> {', '.join(map(unit_file, after))})"
    return [(label, problems_before + problems_after + first_difference(union_before, union_after), len(union_after))]


def unit_file(name: str) -> str:
    """The file of a unit's name: "<module>/prefill_q192_paged.cu sm_90a" -> "prefill_q192_paged.cu"."""
    return name.split("/", 1)[1].split(" ", 1)[0]


def grouped(units: dict[str, Unit]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in sorted(units):
        groups.setdefault(units[name].group, []).append(name)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    base = parser.add_mutually_exclusive_group(required=True)
    base.add_argument("--base", help="git revision whose machine code is the reference")
    base.add_argument("--base-dir", type=Path,
                      help="a folder holding the reference's generated/, templates/include/ and runtime/build.py")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="nvcc processes at once")
    parser.add_argument("--only", help="only modules whose uri contains this")
    parser.add_argument("--keep", type=Path, help="keep the cubins here (default: a temporary folder)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        before = units_of(args.base_dir or checkout(args.base, work / "before"), args.only)
        after = units_of(REPO, args.only)
        groups_before, groups_after = grouped(before), grouped(after)
        if groups_before.keys() != groups_after.keys():
            print("modules differ:", sorted(groups_before.keys() ^ groups_after.keys()))
            return 1
        (work / "cubin" / "before").mkdir(parents=True, exist_ok=True)
        (work / "cubin" / "after").mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            jobs_before = {n: pool.submit(sass_of, u, work / "cubin" / "before") for n, u in before.items()}
            jobs_after = {n: pool.submit(sass_of, u, work / "cubin" / "after") for n, u in after.items()}
            sass_before = {n: job.result() for n, job in jobs_before.items()}
            sass_after = {n: job.result() for n, job in jobs_after.items()}
        results = [result for group in sorted(groups_before) for result in
                   compare_group(group, groups_before[group], groups_after[group], sass_before, sass_after)]
        for label, problems, functions in results:
            print(f"{'identical' if not problems else 'DIFFERENT'}  {label}  ({functions} functions)")
            for problem in problems:
                print(f"    {problem}")
    failed = sum(bool(problems) for _, problems, _ in results)
    print(f"sass_identity: {len(results) - failed} of {len(results)} comparisons identical to "
          f"{args.base or args.base_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
