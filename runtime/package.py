"""Write a prebuilt package (`attnforge package`): a wheel holding built modules and their records.

The wheel `attnforge_modules_<name>-<attnforge version>-py3-none-<platform>.whl` installs the python
package `attnforge_modules_<name>/` (each module's `<uri>/<uri>.so` and `<uri>/src/binding.py`, and
prebuilt.json, see attnforge.prebuilt) and registers it in the entry-point group `attnforge.prebuilt`,
where the runtime finds it. The wheel requires the exact attnforge version that built it. Written with
zipfile (the wheel format is a zip plus three small text files and a RECORD of hashes).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sysconfig
import zipfile
from collections.abc import Sequence
from pathlib import Path

from attnforge.codegen.sources import source_hash
from attnforge.codegen.spec import KernelSpec

from . import integrity
from .build import build_options, cache_root, library_path, version
from .prebuilt import ENTRY_POINT_GROUP, FORMAT, INDEX_NAME
from .settings import Settings

# Fixed member timestamps keep the wheel byte-identical for identical modules.
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class PackageError(RuntimeError):
    pass


def package_name(name: str) -> str:
    """The python package of a prebuilt package called `name` ("llama-fp8" -> attnforge_modules_llama_fp8)."""
    norm = name.strip().lower().replace("-", "_")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_]*", norm):
        raise PackageError(f"--name must be letters, digits, '-' or '_' (a python package name part), got {name!r}")
    return f"attnforge_modules_{norm}"


def platform_tag() -> str:
    return re.sub(r"[^a-zA-Z0-9]", "_", sysconfig.get_platform())


def nvcc_version(config: Settings) -> str | None:
    """The last line of `nvcc --version` (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0"), None without nvcc."""
    if config.nvcc is None:
        return None
    try:
        result = subprocess.run([config.nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = result.stdout.strip().splitlines()
    return lines[-1].strip() if result.returncode == 0 and lines else None


def module_record(spec: KernelSpec, data: bytes, nvcc: str | None, options: tuple[str, ...]) -> dict:
    """prebuilt.json's entry for one module; `data` is its library's bytes, `options` its build options."""
    return {
        "spec": spec.to_dict(),
        "source_hash": source_hash(),
        "build_options": list(options),
        "archs": [arch.value for arch in spec.archs],
        "nvcc_version": nvcc,
        "library": f"{spec.uri}/{spec.uri}.so",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def cached_specs(config: Settings) -> list[KernelSpec]:
    """The specs of every module this attnforge version has built in config.cache_dir whose library
    verifies (what `attnforge package --from-cache` ships: e.g. every module a test run compiled)."""
    specs = []
    for meta in sorted(cache_root(config).glob("*/src/metadata.json")):
        try:
            spec = KernelSpec.from_dict(json.loads(meta.read_text())["spec"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PackageError(f"{meta}: not a module's metadata ({exc}); delete its folder") from None
        if spec.uri == meta.parent.parent.name and integrity.problem(library_path(spec, config)) is None:
            specs.append(spec)
    return specs


def write_wheel(specs: Sequence[KernelSpec], name: str, out_dir: Path, config: Settings) -> Path:
    """Write the wheel of the (already built) modules of `specs` into out_dir; returns its path."""
    package = package_name(name)
    name = package.removeprefix("attnforge_modules_")
    release = version()
    if release == "dev":
        raise PackageError("attnforge has no distribution metadata (not installed); pip install it first, "
                           "a prebuilt package records the attnforge version it matches")
    files: dict[str, bytes] = {f"{package}/__init__.py": _init_text(name).encode()}
    nvcc = nvcc_version(config)
    records = {}
    for spec in specs:
        library = library_path(spec, config)
        data = library.read_bytes()
        records[spec.uri] = module_record(spec, data, nvcc, build_options(config))
        files[f"{package}/{spec.uri}/{spec.uri}.so"] = data
        files[f"{package}/{spec.uri}/src/binding.py"] = (library.parent / "src" / "binding.py").read_bytes()
    index = {"format": FORMAT, "attnforge_version": release, "modules": records}
    files[f"{package}/{INDEX_NAME}"] = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    dist_info = f"{package}-{release}.dist-info"
    tag = f"py3-none-{platform_tag()}"
    files.update(_dist_info(dist_info, package, name, release, tag))
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{package}-{release}-{tag}.whl"
    _write_zip(wheel, files, f"{dist_info}/RECORD")
    return wheel


def _init_text(name: str) -> str:
    return (f'"""Prebuilt attnforge modules ({name}); attnforge finds them through the `{ENTRY_POINT_GROUP}` '
            f'entry point and reads {INDEX_NAME}."""\n')


def _dist_info(dist_info: str, package: str, name: str, release: str, tag: str) -> dict[str, bytes]:
    metadata = (f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {release}\n"
                f"Summary: prebuilt attnforge kernel modules ({name})\nRequires-Dist: attnforge=={release}\n")
    wheel = f"Wheel-Version: 1.0\nGenerator: attnforge {release}\nRoot-Is-Purelib: false\nTag: {tag}\n"
    entry_points = f"[{ENTRY_POINT_GROUP}]\n{name} = {package}\n"
    return {f"{dist_info}/METADATA": metadata.encode(), f"{dist_info}/WHEEL": wheel.encode(),
            f"{dist_info}/entry_points.txt": entry_points.encode()}


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _write_zip(path: Path, files: dict[str, bytes], record_name: str) -> None:
    """The files, then RECORD (path, hash, size of every member; RECORD itself unhashed), atomically."""
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    record += f"{record_name},,\n"
    staged = path.with_suffix(".whl.tmp")
    with zipfile.ZipFile(staged, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in [*files.items(), (record_name, record.encode())]:
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    staged.replace(path)
