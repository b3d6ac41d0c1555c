"""Build times: the cold build of one module per family (fa2 decode, fa2 prefill, fa3 prefill bf16 and
e4m3) against FlashInfer's cold JIT of the same module, then `attnforge build` of the whole default
manifest into an empty cache.

    attnforge bench build [--arch 90a] [--head-dim 128] [--no-peers] [--no-manifest] [--keep-cache DIR]
                          [--out F.json]

Every build runs alone, in a fresh process, into an empty cache; times include the process's start.
In order: ours (~5 + 5 + 30-50 + 30-60 s on 16 cores), the manifest (~90-150 s for sm90a), FlashInfer's
(~15 + 25 + 86 s; skipped when flashinfer is not importable, which is recorded, never an error).
The record is rewritten after each part, so a run stopped by a timeout keeps the parts it finished.
Exit status 1 when one of our builds failed (a failed peer is a note, not a failure)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from attnforge.codegen.spec import Arch

from . import _cold_build, _manifest_build, _record

WHAT = "render + nvcc + link of one module into an empty cache, in a fresh process (its start included)"
FLASHINFER_WHAT = ("build_jit_specs of the matching module into an empty FLASHINFER_WORKSPACE_BASE, in a fresh "
                   f"process (its start included), FLASHINFER_CUDA_ARCH_LIST={_cold_build.FLASHINFER_ARCH}")


def nvcc_version() -> str:
    """nvcc's release line ("Cuda compilation tools, release 13.0, V13.0.88"), or "unknown"."""
    from attnforge.settings import settings

    nvcc = settings().nvcc
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30) if nvcc else None
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = done.stdout.strip().splitlines() if done and done.returncode == 0 else []
    return next((line for line in lines if "release" in line), lines[-1] if lines else "unknown")


def cold_rows(args) -> tuple[list[dict], list[str]]:
    """One row per (arch, family, head dim) to cold-build, and a line for each the rules refuse (fa3 off
    sm90a, fp8 fa3 at head dim 80, ...)."""
    rows, refused = [], []
    for arch in args.arch:
        for family in map(_cold_build.family, args.families or _cold_build.FAMILY_KEYS):
            for head_dim in args.head_dim:
                row = dict(module=f"{family.label} hd{head_dim}", family=family.key, arch=f"sm_{arch}",
                           head_dim=head_dim, cold_build_s=None, flashinfer_s=None, notes="")
                why = _cold_build.refusal(spec_of(row))
                if why:
                    refused.append(f"{family.key} --arch {arch} --head-dim {head_dim} is refused: {why}")
                else:
                    rows.append(row)
    return rows, refused


def spec_of(row: dict):
    return _cold_build.family(row["family"]).spec(row["head_dim"], Arch.parse(row["arch"].removeprefix("sm_")))


def config(args=None, peer_version: str | None = None, peer_note: str = "") -> dict:
    """What the JSON record says about the builds and the machine."""
    args = args or parse_args([])
    manifest = None if args.no_manifest else dict(
        name=args.manifest.name if args.manifest else "default", archs=[f"sm_{a}" for a in args.arch],
        parallel=args.jobs or _parallel(), command=" ".join(
            ["attnforge build", *(["--manifest", args.manifest.name] if args.manifest else []),
             *(f"--arch {a}" for a in args.arch), f"-j {args.jobs or _parallel()}", "--cache-dir <empty dir>"]))
    return dict(what=WHAT, cpu_count=os.cpu_count(), nvcc=nvcc_version(), flashinfer_what=FLASHINFER_WHAT,
                flashinfer_version=peer_version, flashinfer_note=peer_note, manifest=manifest)


def _parallel() -> int:
    from attnforge import build_pool

    return build_pool.default_parallel()


def run_ours(rows: list[dict]) -> bool:
    """Cold-build every row's module, printing each; True when all built."""
    ok = True
    for row in rows:
        timing = _cold_build.ours(spec_of(row))
        row["cold_build_s"] = timing.seconds
        if timing.error:
            ok = False
            row["notes"] = f"our build failed ({timing.error.splitlines()[0]})"
            print(f"{row['module']} {row['arch']}: build failed\n{timing.error}")
        print(f"| {row['module']} | {row['arch']} | {_cells(row['cold_build_s'])} |", flush=True)
    return ok


def run_peers(rows: list[dict]) -> tuple[str | None, str]:
    """FlashInfer's cold JIT of each sm_90a row's counterpart, one at a time; (its version, a note)."""
    paired = [r for r in rows if r["arch"] == "sm_90a" and _cold_build.family(r["family"]).flashinfer]
    if not paired:
        return None, "not run: no sm_90a row with a FlashInfer counterpart"
    version, note = _cold_build.flashinfer_version()
    if version is None:
        print(f"peers: {note}")
        return None, note
    for row in paired:
        timing = _cold_build.flashinfer(_cold_build.family(row["family"]).flashinfer, row["head_dim"])
        row["flashinfer_s"] = timing.seconds
        if timing.error:
            row["notes"] = "; ".join(filter(None, [row["notes"], f"FlashInfer's build failed "
                                                   f"({timing.error.splitlines()[-1]})"]))
            print(f"FlashInfer {row['module']}: build failed\n{timing.error}")
        print(f"| {row['module']} | FlashInfer | {_cells(row['flashinfer_s'])} |", flush=True)
    return version, ""


def run_manifest(args) -> tuple[list[dict], dict, bool]:
    """`attnforge build` of the manifest: its per-module rows, its totals and whether it succeeded."""
    done = _manifest_build.build(args.manifest, args.arch, args.jobs or _parallel(), args.keep_cache)
    # a failed module is a row of the table; only a run without a table needs a note
    total = dict(modules=len(done.modules), **done.counts, build_s=done.build_s, wall_s=done.wall_s, cpu_s=done.cpu_s,
                 exit_code=done.exit_code, notes=done.error.splitlines()[0] if done.error and not done.modules else "")
    print("| module | seconds | size (MiB) |\n|---|---|---|")
    for row in done.modules:
        seconds = row["status"] if row["seconds"] is None else f"{row['seconds']:.1f}"
        print(f"| {row['module']} | {seconds} | {_cells(row['size_mib'])} |")
    print(f"manifest: {total['modules']} modules in {done.wall_s:.1f} s wall, {done.cpu_s:.0f} CPU s, "
          f"exit {done.exit_code}", flush=True)
    if done.error:
        print(done.error)
    return done.modules, total, done.exit_code == 0 and not done.error


def _cells(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _arch(text: str) -> str:
    try:
        return Arch.parse(text).value
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="attnforge bench build", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", type=_arch, default=["90a"],
                        help="compile targets, e.g. 80 90a (default 90a); fa3 families are built for 90a only, "
                             "FlashInfer's peers pair with the sm_90a rows")
    parser.add_argument("--head-dim", type=_positive, nargs="+", default=[128],
                        help="head dim of the cold-built modules, ours and FlashInfer's (default 128); the "
                             "manifest keeps its own")
    parser.add_argument("--families", nargs="+", choices=_cold_build.FAMILY_KEYS, metavar="FAMILY",
                        help=f"cold-build only these ({', '.join(_cold_build.FAMILY_KEYS)}); default: every "
                             "family the arch has")
    parser.add_argument("--no-peers", action="store_true", help="skip FlashInfer's cold builds")
    parser.add_argument("--no-manifest", action="store_true", help="skip `attnforge build` of the manifest")
    parser.add_argument("--keep-cache", type=Path, metavar="DIR",
                        help="build the manifest into DIR (new or empty) and keep it, e.g. for `attnforge package`")
    parser.add_argument("--manifest", type=Path, metavar="FILE.toml",
                        help="the manifest to build (default: the packaged default manifest)")
    parser.add_argument("-j", "--jobs", type=_positive, metavar="N",
                        help="the manifest's module builds at once (default: attnforge build's, one per 2 cores)")
    _record.add_out_option(parser)
    args = parser.parse_args(argv)
    if args.manifest is not None and not args.manifest.is_file():
        parser.error(f"--manifest: no such file: {args.manifest}")
    if args.keep_cache is not None and (args.keep_cache.is_file() or
                                        args.keep_cache.is_dir() and any(args.keep_cache.iterdir())):
        parser.error(f"--keep-cache: {args.keep_cache} exists and is not an empty folder; a cold build needs an "
                     "empty cache")
    rows, refused = cold_rows(args)
    if args.families is not None and refused:
        parser.error(f"--families {refused[0]}")  # named families must all build
    if not rows:
        parser.error(f"no family to cold-build for --arch {' '.join(args.arch)} --head-dim "
                     f"{' '.join(map(str, args.head_dim))}: {'; '.join(refused)}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    (rows, refused), tables = cold_rows(args), {}
    for line in refused:
        print(f"skipped {line}")
    peer = (None, "not run (--no-peers)" if args.no_peers else "not run (the benchmark stopped before)")

    def save() -> None:
        if args.out:
            _record.write(args.out, "build", argv, config(args, *peer), tables=dict(build=rows, **tables))

    print("| module | arch | cold build (s), incl. process start |\n|---|---|---|", flush=True)
    ok = run_ours(rows)
    save()
    # The manifest before the peers: a kept cache is then ready while FlashInfer's builds run.
    if not args.no_manifest:
        modules, total, built = run_manifest(args)
        tables.update(manifest=modules, manifest_total=[total])
        ok = ok and built
        save()
    if not args.no_peers:
        peer = run_peers(rows)
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
