"""The run() overhead benchmark's child processes, without a GPU: a library that fails in its child
raises in the parent with the child's error, and a child's JSON rows come back as dicts."""

from __future__ import annotations

import json
import subprocess

import pytest

from attnforge.benchmarks import _overhead


def test_a_failing_child_raises_with_its_error():
    with pytest.raises(RuntimeError, match="no_such_library overhead measurement failed(.|\n)*ModuleNotFoundError"):
        _overhead.in_own_process("no_such_library", "NHD")


def test_rows_are_the_childs_json_lines(monkeypatch):
    row = dict(tensor_cores=False, eager_us=20.0, graph_us=10.0, host_us=19.5)
    done = subprocess.CompletedProcess([], 0, stdout="[attnforge] compiling x\n" + json.dumps(row) + "\n", stderr="")
    monkeypatch.setattr(_overhead.subprocess, "run", lambda *args, **kwargs: done)
    assert _overhead.in_own_process("attnforge", "NHD") == [row]
