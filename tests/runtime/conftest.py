"""Fixtures of the runtime tests: the host planners compiled into test shims."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import jinja2
import pytest

from attnforge.codegen.sources import templates_dir


def ctypes_mirror(struct) -> type[ctypes.Structure]:
    """A ctypes Structure with the fields of an attnforge.codegen.abi struct."""
    return type(struct.name, (ctypes.Structure,), {"_fields_": [(f.name, getattr(ctypes, f.ctypes_name))
                                                                 for f in struct.fields]})


@pytest.fixture(scope="session")
def plan_shim(tmp_path_factory):
    """build(header, function, args, info): host/<header> compiled into a shared library whose
    shim_plan(args, info) calls attnforge::host::<function> (nvcc as a host compiler, since error.h
    includes the CUDA runtime header; no device code). Built once per header per run; the library's
    `mirrors` maps each struct's name to its ctypes Structure."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(Path(__file__).parent)),
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    built = {}

    def build(header: str, function: str, args, info) -> ctypes.CDLL:
        if header not in built:
            folder = tmp_path_factory.mktemp(header.replace(".", "_") + "_shim")
            source = folder / "shim.cu"
            source.write_text(env.get_template("plan_shim.cpp.jinja").render(
                header=header, function=function, structs=(args, info)))
            library = folder / "shim.so"
            subprocess.run(["nvcc", "-std=c++17", "-O1", "-shared", "-Xcompiler", "-fPIC", "-I",
                            str(templates_dir() / "include"), str(source), "-o", str(library)], check=True)
            lib = ctypes.CDLL(str(library))
            lib.shim_last_error.restype = ctypes.c_char_p
            lib.shim_abi.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
            lib.mirrors = {struct.name: ctypes_mirror(struct) for struct in (args, info)}
            lib.shim_plan.argtypes = [ctypes.POINTER(lib.mirrors[args.name]), ctypes.POINTER(lib.mirrors[info.name])]
            lib.shim_plan.restype = ctypes.c_int32
            built[header] = lib
        return built[header]

    return build
