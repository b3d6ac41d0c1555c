"""`attnforge`: the command line over the codegen package (generate, validate, list, matrix, build,
package, bench).

Every subcommand returns an exit status instead of raising: 0 success, 1 a module failed to compile,
2 bad input or a spec that a rule refuses. Errors are one line (a failed compile adds its compiler
output); a traceback would mean a bug in attnforge, not in the input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import logging
import pkgutil
import sys
import time
from pathlib import Path

from . import manifest, matrix, render
from .dtypes import DType
from .rules import check
from .spec import Arch, Backend, KernelSpec, Kind, PosEncoding

EXIT_OK = 0
EXIT_FAILED = 1  # a module failed to compile
EXIT_INVALID = 2  # the same status argparse uses for bad arguments

INTRO = """\
attnforge generates attention-kernel modules (CUDA sources plus a Python binding).

A *spec* names one module: kind (decode/prefill), backend (fa2/fa3), the dtypes of q, kv and o,
head dims, variant flags (sliding window, soft cap, ...) and target archs. A *manifest* is a TOML
file listing many specs at once; the packaged default manifest holds what serving engines use.
Every spec is checked against one table of rules; a refused spec says which rule and what to use
instead, and nothing is written for it."""

EXAMPLES = """\
examples:
  attnforge generate                             # the default manifest into ./generated
  attnforge generate --kind decode --dtype-q fp16 --head-dim 128 --out build/
  attnforge validate --backend fa3 --kind prefill --dtype-q bf16 --dtype-kv e4m3
  attnforge list --manifest my_models.toml
  attnforge matrix --kind decode
  attnforge build --arch 90a                     # compile the default manifest's modules ahead of use
  attnforge package --manifest my_models.toml --arch 90a --name my_models --out dist/
  attnforge bench decode --help"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line instead of argparse's usage dump: the fix is usually obvious from the message.
        self.exit(EXIT_INVALID, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def _typed(parse, what: str):
    """Wrap a parser so argparse reports its ValueError as a one-line usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except (ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(str(exc) or f"bad {what} {text!r}") from None

    convert.__name__ = what  # argparse names the argument type in some messages
    return convert


def _positive(what: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) == 0:
            raise ValueError(f"{what} must be a positive integer, got {text!r}")
        return int(text)

    return _typed(parse, what)


# What an enum option is called in its error, and why a value users reach for is not a choice.
_ENUM_WORDS = {Kind: "kind", Backend: "backend", PosEncoding: "positional encoding"}
_ENUM_HINTS = {(Backend, "auto"): " ('auto' is chosen at run time by the wrappers' backend=\"auto\"; a module names one)"}


def _enum(cls):
    def parse(text: str):
        try:
            return cls(text.upper() if cls is PosEncoding else text.lower())
        except ValueError:
            choices = ", ".join(member.value for member in cls)
            hint = _ENUM_HINTS.get((cls, text.lower()), "")
            raise ValueError(f"unknown {_ENUM_WORDS[cls]} {text!r}; expected one of {choices}{hint}") from None

    return _typed(parse, cls.__name__.lower())


_DTYPE = _typed(DType.parse, "dtype")
_HEAD_DIM = _positive("a head dim")
_DTYPE_NAMES = ", ".join(d.short for d in DType)

# Defaults of the spec options; None in the parsed namespace means "not given", so that
# `generate` can tell a single spec from the manifest.
_SPEC_DEFAULTS = dict(
    kind=Kind.DECODE,
    backend=Backend.FA2,
    dtype_q=DType.BF16,
    head_dim_qk=128,
    pos_encoding=PosEncoding.NONE,
    use_sliding_window=False,
    use_logits_soft_cap=False,
    use_custom_mask=False,
    archs=[Arch.SM90A],
)


def _spec_options() -> argparse.ArgumentParser:
    p = _Parser(add_help=False)
    g = p.add_argument_group("spec options (any of them selects a single spec instead of a manifest)")
    g.add_argument("--kind", type=_enum(Kind), metavar="KIND", help="decode (default) or prefill")
    g.add_argument("--backend", type=_enum(Backend), metavar="BACKEND",
                   help="fa2 (default; sm80 and newer) or fa3 (sm90a only)")
    g.add_argument("--dtype-q", type=_DTYPE, metavar="DTYPE", help=f"query dtype: {_DTYPE_NAMES} (default bf16)")
    g.add_argument("--dtype-kv", type=_DTYPE, metavar="DTYPE", help="KV-cache dtype (default: the query's)")
    g.add_argument("--dtype-o", type=_DTYPE, metavar="DTYPE",
                   help="output dtype (default: the query's; bf16 for an fp8 query)")
    g.add_argument("--head-dim", "--head-dim-qk", dest="head_dim_qk", type=_HEAD_DIM, metavar="N",
                   help="head dim of q and k, and of v unless --head-dim-vo is given (default 128)")
    g.add_argument("--head-dim-vo", type=_HEAD_DIM, metavar="N", help="head dim of v and o, e.g. 128 with qk 192")
    g.add_argument("--pos-encoding", type=_enum(PosEncoding), metavar="MODE",
                   help="in-kernel positional encoding: " + ", ".join(p.value for p in PosEncoding) + " (default NONE)")
    g.add_argument("--sliding-window", dest="use_sliding_window", action="store_true", default=None,
                   help="compile in the sliding-window (window_left) path")
    g.add_argument("--soft-cap", dest="use_logits_soft_cap", action="store_true", default=None,
                   help="compile in the logits soft cap path")
    g.add_argument("--custom-mask", dest="use_custom_mask", action="store_true", default=None,
                   help="compile in a custom (user-given) mask")
    g.add_argument("--arch", dest="archs", action="append", type=_typed(Arch.parse, "arch"), metavar="ARCH",
                   help="target arch, repeatable: " + ", ".join(a.value for a in Arch) + " (default 90a)")
    return p


def _manifest_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--manifest", type=Path, metavar="FILE",
                   help="TOML manifest of specs (default: the packaged default manifest)")


def _given_spec_fields(args: argparse.Namespace) -> dict:
    fields = ("kind", "backend", "dtype_q", "dtype_kv", "dtype_o", "head_dim_qk", "head_dim_vo", "pos_encoding",
              "use_sliding_window", "use_logits_soft_cap", "use_custom_mask", "archs")
    return {name: getattr(args, name) for name in fields if getattr(args, name) is not None}


def _spec_from(given: dict) -> KernelSpec:
    fields = {**_SPEC_DEFAULTS, **given}
    fields.setdefault("dtype_kv", fields["dtype_q"])
    fields.setdefault("dtype_o", fields["dtype_q"].default_output)
    fields.setdefault("head_dim_vo", fields["head_dim_qk"])
    fields["archs"] = tuple(fields["archs"])
    return KernelSpec(**fields)


class _InputError(Exception):
    """Bad input found after argument parsing (missing or malformed manifest, conflicting options)."""


def _selection(args: argparse.Namespace) -> tuple[list[KernelSpec], manifest.Expansion | None]:
    """The single spec of the spec options, or the manifest's expansion."""
    given = _given_spec_fields(args)
    if given:
        if args.manifest is not None:
            raise _InputError("give either --manifest or spec options, not both")
        return [_spec_from(given)], None
    expansion = _load_manifest(args.manifest)
    return expansion.specs, expansion


def _load_manifest(path: Path | None) -> manifest.Expansion:
    path = path or manifest.default_manifest_path()
    try:
        return manifest.load(path)
    except FileNotFoundError:
        raise _InputError(f"manifest {path} does not exist") from None
    except (OSError, manifest.ManifestError) as exc:
        raise _InputError(str(exc).replace("\n", " ")) from None


def _print_violations(spec: KernelSpec) -> bool:
    """Print every rule the spec violates; True when there was at least one."""
    violations = check(spec)
    if violations:
        print(f"refused {spec.name}:")
        for rule in violations:
            print(f"  {rule.render(spec)}")
    return bool(violations)


def _print_refused(expansion: manifest.Expansion) -> None:
    for spec, violations in expansion.refused:
        print(f"skipped {spec.name} ({', '.join(r.id for r in violations)})")


def cmd_generate(args: argparse.Namespace) -> int:
    specs, expansion = _selection(args)
    if args.prune and expansion is None:
        raise _InputError("--prune removes the modules a manifest no longer lists; give it with a manifest, "
                          "not with spec options")
    # Check everything before writing anything, so a refused spec leaves the output folder alone.
    if any([_print_violations(spec) for spec in specs]):
        return EXIT_INVALID
    modules = [render.render(spec) for spec in specs]
    for module in modules:
        print(f"wrote {render.write(module, args.out)}")
    summary = f"{len(modules)} module(s) written to {args.out}"
    if expansion is not None:
        keep = {m.uri for m in modules}
        # Nothing is deleted unless asked: an --out shared with other modules keeps them.
        stale = render.prune(args.out, keep) if args.prune else render.stale(args.out, keep)
        for uri in stale:
            print(f"removed {uri} (not in the manifest)" if args.prune
                  else f"kept {uri} (not in the manifest; --prune removes it)")
        _print_refused(expansion)
        ids = sorted({r.id for _, violations in expansion.refused for r in violations})
        summary += f", {len(expansion.refused)} refused by rules" + (f" ({', '.join(ids)})" if ids else "")
        if stale:
            summary += f", {len(stale)} stale " + ("removed" if args.prune else "kept (--prune removes them)")
    print(summary)
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    specs, expansion = _selection(args)
    status = EXIT_OK
    for spec in specs:
        if _print_violations(spec):
            status = EXIT_INVALID
        else:
            print(f"ok {spec.name}")
    if expansion is not None:
        # Groups with on_invalid = "skip" refuse these on purpose; they are reported, not errors.
        _print_refused(expansion)
    return status


def cmd_list(args: argparse.Namespace) -> int:
    for spec in _load_manifest(args.manifest).specs:
        print(spec.uri)
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else list(Kind)
    backends = [args.backend] if args.backend else list(Backend)
    table = [row for row in matrix.rows(kinds, backends) if row.supported or not args.supported_only]
    print(matrix.markdown(table), end="")
    return EXIT_OK


BUILD_TIMES = """\
how long: measured on an H200 host with 16 cores, a module compiles cold in about 3 s (fa2 decode),
5 s (fa2 prefill), 15 s (fa3 prefill bf16) or 19 s (fa3 prefill e4m3); the default manifest for
--arch 90a (54 modules) takes about 140 s, 1860 CPU seconds of nvcc (docs/benchmarks.md, Build times).
Modules already in the cache are skipped ("cached" in the table)."""


def _build_selection(args: argparse.Namespace) -> list[KernelSpec]:
    """The specs to build: the spec options' single spec, or the manifest's specs, with --arch
    replacing each spec's archs (specs that become equal merge; ones a rule then refuses are skipped)."""
    given = _given_spec_fields(args)
    archs = given.pop("archs", None)
    if given:
        if args.manifest is not None:
            raise _InputError("give either --manifest or spec options, not both")
        spec = _spec_from({**given, **({"archs": archs} if archs else {})})
        if _print_violations(spec):
            raise _InputError(f"{spec.name} is refused by the rules above")
        return [spec]
    expansion = _load_manifest(args.manifest)
    _print_refused(expansion)
    if not archs:
        return expansion.specs
    specs = dict.fromkeys(dataclasses.replace(spec, archs=tuple(archs)) for spec in expansion.specs)
    checked = [(spec, check(spec)) for spec in specs]
    for spec, violations in checked:
        if violations:
            print(f"skipped {spec.name} ({', '.join(r.id for r in violations)})")
    kept = [spec for spec, violations in checked if not violations]
    if not kept:
        raise _InputError(f"no spec of the manifest is valid for --arch {' '.join(a.value for a in archs)}")
    return kept


def _cache_settings(args: argparse.Namespace):
    """The settings, with --cache-dir in place of the cache they name."""
    from attnforge.settings import settings

    config = settings()
    return config if args.cache_dir is None else dataclasses.replace(config, cache_dir=args.cache_dir.absolute())


def _build_modules(args: argparse.Namespace) -> tuple[list, object]:
    """Build the selection (progress bar on a terminal); returns the outcomes and the settings used."""
    from attnforge import build_pool

    specs = _build_selection(args)
    config = _cache_settings(args)
    parallel = args.jobs or build_pool.default_parallel()
    started = time.perf_counter()
    with _progress(len(specs)) as advance:
        outcomes = build_pool.build_all(specs, parallel, config, on_done=advance)
    print(build_pool.summary_table(outcomes, time.perf_counter() - started))
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        print(f"attnforge {args.command}: {len(failed)} module(s) failed to build: "
              f"{', '.join(o.spec.uri for o in failed)}", file=sys.stderr)
        for outcome in failed:
            print(f"\n--- {outcome.spec.uri}\n{outcome.error}", file=sys.stderr)
    return outcomes, config


@contextlib.contextmanager
def _progress(total: int):
    """A tqdm bar on stderr, quiet when stderr is not a terminal; log lines go above the bar."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with tqdm(total=total, unit="module", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        counts = dict.fromkeys(("built", "cached", "failed"), 0)

        def advance(outcome) -> None:
            counts[outcome.status] += 1
            bar.set_postfix(counts, refresh=False)
            bar.update()

        with logging_redirect_tqdm(loggers=[logging.getLogger("attnforge")]):
            yield advance


def cmd_build(args: argparse.Namespace) -> int:
    outcomes, _ = _build_modules(args)
    return EXIT_FAILED if any(o.status == "failed" for o in outcomes) else EXIT_OK


def _package_label(args: argparse.Namespace) -> str:
    """--name, else the manifest's file name; checked before anything is built."""
    from attnforge.package import PackageError, package_name

    selects = args.manifest is not None or _given_spec_fields(args)
    if args.from_cache and selects:
        raise _InputError("--from-cache packages what the cache holds: give no --manifest, --arch or spec options")
    if args.name is None and (args.from_cache or args.manifest is None and _given_spec_fields(args).keys() - {"archs"}):
        raise _InputError("--name is required with spec options or --from-cache (it names the package)")
    name = args.name or (args.manifest.stem if args.manifest is not None else "default")
    try:
        package_name(name)
    except PackageError as exc:
        raise _InputError(str(exc)) from None
    return name


def cmd_package(args: argparse.Namespace) -> int:
    from attnforge.package import PackageError, cached_specs, write_wheel

    name = _package_label(args)
    try:
        if args.from_cache:
            config = _cache_settings(args)
            specs = cached_specs(config)
            if not specs:
                raise _InputError(f"--from-cache: no built module of this attnforge version in {config.cache_dir}")
        else:
            outcomes, config = _build_modules(args)
            if any(o.status == "failed" for o in outcomes):
                return EXIT_FAILED
            specs = [o.spec for o in outcomes]
        wheel = write_wheel(specs, name, args.out, config)
    except (PackageError, OSError) as exc:
        raise _InputError(str(exc)) from None
    print(f"wrote {wheel} ({len(specs)} module(s)); install it with: pip install {wheel}")
    return EXIT_OK


def _benchmark_modules() -> list[pkgutil.ModuleInfo]:
    try:
        package = importlib.import_module("attnforge.benchmarks")
    except ImportError:
        return []
    return sorted((m for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")),
                  key=lambda m: m.name)


def _benchmarks() -> list[str]:
    return [m.name for m in _benchmark_modules()]


def _summary(info: pkgutil.ModuleInfo) -> str:
    """A benchmark module's docstring up to its first colon, read without importing the module (that imports
    torch): "Batch decode benchmark"."""
    try:
        spec = info.module_finder.find_spec(info.name)
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
    except (AttributeError, OSError, SyntaxError, TypeError, ValueError):
        return ""
    return doc.split("\n\n")[0].replace("\n", " ").split(": ")[0].rstrip(".")


def _bench_epilog() -> str:
    lines = [f"  {m.name:<8} {_summary(m)}" for m in _benchmark_modules()]
    return "available benchmarks:\n" + ("\n".join(lines) or "  none (attnforge.benchmarks is not installed)")


def cmd_bench(args: argparse.Namespace) -> int:
    available = _benchmarks()
    if args.name not in available:
        problem = "name a benchmark" if args.name is None else f"unknown benchmark {args.name!r}"
        print(f"attnforge bench: error: {problem}; available: {', '.join(available) or 'none'}", file=sys.stderr)
        return EXIT_INVALID
    module = importlib.import_module(f"attnforge.benchmarks.{args.name}")
    return int(module.main(args.args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnforge", description=INTRO, epilog=EXAMPLES,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    spec_opts = _spec_options()

    def add(name: str, func, help: str, epilog: str, parents=()):
        p = sub.add_parser(name, help=help, description=help, epilog="example:\n  " + epilog,
                           parents=list(parents), formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    p = add("generate", cmd_generate,
            "Render module sources (one folder per module uri) for a manifest or a single spec. "
            "Module folders in --out that the manifest does not list are named and kept; --prune removes them.",
            "attnforge generate --kind decode --dtype-q bf16 --head-dim 256 --soft-cap --out build/", [spec_opts])
    _manifest_option(p)
    p.add_argument("--out", type=Path, default=Path("generated"), metavar="DIR",
                   help="output folder (default: ./generated)")
    p.add_argument("--prune", action="store_true",
                   help="remove module folders in --out that the manifest does not list (each is named)")

    p = add("validate", cmd_validate,
            "Check specs against the rules; print 'ok <name>' or every violated rule with a suggestion. "
            "Exit status 2 if any spec is refused.",
            "attnforge validate --backend fa3 --kind prefill --dtype-q bf16 --dtype-kv e4m3", [spec_opts])
    _manifest_option(p)

    p = add("list", cmd_list, "Print the uri (module name) of every spec in a manifest.",
            "attnforge list --manifest my_models.toml")
    _manifest_option(p)

    p = add("matrix", cmd_matrix, "Print the support matrix (markdown), computed from the rules.",
            "attnforge matrix --kind decode --supported-only")
    p.add_argument("--kind", type=_enum(Kind), metavar="KIND", help="only this kind (decode or prefill)")
    p.add_argument("--backend", type=_enum(Backend), metavar="BACKEND", help="only this backend (fa2 or fa3)")
    p.add_argument("--supported-only", action="store_true", help="omit refused combinations")

    def add_build_options(p: argparse.ArgumentParser) -> None:
        _manifest_option(p)
        p.add_argument("-j", "--jobs", type=_positive("-j"), metavar="N",
                       help="modules built at once (default: one per 2 cores); their ninjas share one jobserver "
                            "of as many nvcc slots as cores (MAX_JOBS if set), at most one nvcc per 1.5 GB of "
                            "memory")
        p.add_argument("--cache-dir", type=Path, metavar="DIR",
                       help="module cache to build into (default: $ATTNFORGE_CACHE_DIR or ~/.cache/attnforge)")

    p = add("build", cmd_build,
            "Compile every module of a manifest (default: the packaged one) or of a single spec into the cache, "
            "several at once, so that first use loads instead of compiling. --arch replaces the manifest's "
            "archs. Prints a table (module, seconds, size); exit status 1 names every module that failed.",
            "attnforge build --arch 90a -j 4\n  attnforge build --manifest my_models.toml --arch 80 --arch 90a\n\n"
            + BUILD_TIMES, [spec_opts])
    add_build_options(p)

    p = add("package", cmd_package,
            "Build like `attnforge build`, then write a wheel attnforge_modules_<name>-<version>-py3-none-"
            "<platform>.whl holding the modules and their records (attnforge version, source hash, archs, nvcc "
            "version, sha256 and size). Installed, it is found before the cache: no lock, no compiler. "
            "ATTNFORGE_PREBUILT_PATH may instead list unpacked package folders.",
            "attnforge package --manifest my_models.toml --arch 90a --name my_models --out dist/\n\n"
            + BUILD_TIMES, [spec_opts])
    add_build_options(p)
    p.add_argument("--out", type=Path, default=Path("dist"), metavar="DIR",
                   help="folder for the wheel (default: ./dist)")
    p.add_argument("--from-cache", action="store_true",
                   help="package every module already built in the cache (e.g. all a test run compiled) "
                        "instead of building a manifest; needs --name")
    p.add_argument("--name", metavar="NAME",
                   help="package name part: letters, digits, '-', '_' (default: the manifest's file name, "
                        "'default' for the packaged manifest)")

    p = add("bench", cmd_bench, "Run a benchmark from attnforge.benchmarks; the remaining arguments go to it. "
            "Each writes its tables to stdout and, with --out F.json, a JSON record; `report` renders "
            "docs/benchmarks.md from those records.",
            "attnforge bench decode --out bench-decode.json\n"
            "  attnforge bench report bench-*.json --output docs/benchmarks.md\n\n" + _bench_epilog())
    p.add_argument("name", nargs="?", help="benchmark name, e.g. decode (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error; argparse already printed the message
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID
    try:
        return args.func(args)
    except _InputError as exc:
        print(f"attnforge {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":
    sys.exit(main())
