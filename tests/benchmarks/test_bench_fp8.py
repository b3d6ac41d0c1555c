"""bench fp8 without a GPU: its command line, the fp8 <-> bf16 contents, the pre-timing check and the
tables (CPU)."""

from __future__ import annotations

import pytest
import torch

from attnforge.benchmarks import _peers, fp8, prefill

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_defaults_are_the_acceptance_config():
    args = fp8.parse_args([])
    assert args.shapes == [(4, 4096)] and args.head_dims == [128, 256]
    assert (args.iters, args.warmup, args.no_peers, args.no_decode, args.out) == (20, 5, False, False, None)


def test_head_dims_refuse_one_without_an_fp8_kernel(capsys):
    with pytest.raises(SystemExit) as info:
        fp8.parse_args(["--head-dims", "80"])
    assert info.value.code == 2
    assert "--head-dims" in capsys.readouterr().err


def test_head_dims_take_every_fa3_fp8_dim():
    assert fp8.parse_args(["--head-dims", "64", "96", "192"]).head_dims == [64, 96, 192]


def test_shapes_parse_like_bench_prefill(capsys):
    assert fp8.parse_args(["--shapes", "1x16384", "4X4096"]).shapes == [(1, 16384), (4, 4096)]
    with pytest.raises(SystemExit):
        fp8.parse_args(["--shapes", "4by4096"])
    assert "BATCHxLEN" in capsys.readouterr().err


@pytest.mark.parametrize("scale", [fp8.SCALES.q, fp8.SCALES.k, fp8.SCALES.v])
def test_dequantized_values_are_exact_in_bf16(scale):
    """The bf16 runs see exactly the values the fp8 run stands for: every finite e4m3 value x scale."""
    finite = E4M3_VALUES[E4M3_VALUES.float().isfinite()]
    assert torch.equal(fp8.dequantize(finite, scale).float(), finite.float() * scale)
    assert torch.equal(fp8.quantize(fp8.dequantize(finite, scale), scale).float(), finite.float())


def test_converted_gives_the_cache_the_k_and_v_scales():
    ones = torch.ones(4, 2, 8)
    problem = prefill.Problem(prefill.Heads(2, 2, 8), ones, ones, ones, torch.tensor([0, 4], dtype=torch.int32),
                              (torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2, 8)), torch.tensor([0, 1]),
                              torch.tensor([0]), torch.tensor([4]))
    out = fp8.converted(problem, lambda x, s: x * s, fp8.Scales(q=2.0, k=3.0, v=5.0))
    firsts = [t.flatten()[0].item() for t in (out.q, out.k, out.v, *out.cache)]
    assert firsts == [2.0, 3.0, 5.0, 3.0, 5.0]


def test_check_refuses_nan_and_large_error_and_passes_rounding():
    ref = torch.randn(64, 4, 16)
    assert fp8.check(ref + 1e-3 * torch.randn_like(ref), ref, "x")[0] < fp8.MAX_REL_L2
    with pytest.raises(AssertionError, match="relative L2"):
        fp8.check(ref + 0.2 * torch.randn_like(ref), ref, "x")
    poisoned = ref.clone()
    poisoned[3, 1, 2] = float("nan")
    with pytest.raises(AssertionError, match="nan"):
        fp8.check(poisoned, ref, "x")


def test_checked_once_catches_an_output_left_unwritten():
    """The outputs are poisoned before the check run: a kernel that writes nothing fails it."""
    src = torch.randn(8, 2, 16)
    ref, good, lazy = (torch.empty_like(src) for _ in range(3))
    runs = {"bf16": (lambda: ref.copy_(src), ref), "fp8": (lambda: good.copy_(src), good)}
    assert fp8.checked_once(runs, "bf16", "ok") == (0.0, 0.0)
    good.zero_()
    with pytest.raises(AssertionError, match="lazy, fp8"):
        fp8.checked_once({"bf16": runs["bf16"], "fp8": (lambda: None, lazy)}, "bf16", "lazy")


def _prefill_row(cudnn):
    return fp8.PrefillRow(4, 4096, 256, False, 900.0, 1000.0, 625.0, cudnn, 2e-2, 0.1)


def test_prefill_table_reports_ratios_and_na_without_peer():
    table = fp8.markdown([_prefill_row(500.0), _prefill_row(None)], [], 4000.0)
    lines = table.splitlines()
    with_peer, without = lines[-2], lines[-1]
    assert with_peer.startswith("| 4 x 4096 | 256 (16/4) | no | 900.0 | 1000.0 | 625.0 | 500.0 | 1.60 | 2.00 |")
    assert "| 625.0 | n/a | 1.60 | n/a |" in without
    header = next(line for line in lines if line.startswith("| batch x len"))
    assert header.count("|") == with_peer.count("|")
    assert "Decode" not in table


def test_decode_table_has_a_speedup_per_path_and_group():
    rows = [fp8.DecodeRow(path, group, 300.0, 150.0, 40.0, 41.0, 1e-2, 3e-3)
            for path in ("CUDA cores (fa2)", "tensor cores (fa3), e4m3 q") for group in prefill.DECODE_GROUPS]
    table = fp8.markdown([], rows, 4000.0)
    assert "4000 GB/s" in table and "Prefill" not in table
    body = [line for line in table.splitlines() if line.startswith("| CUDA") or line.startswith("| tensor")]
    assert len(body) == 2 * len(prefill.DECODE_GROUPS)
    assert all("| 2.00 |" in line for line in body)


def test_fp8_kv_prefill_table_reports_the_ratio_to_the_bf16_cache():
    rows = [fp8.Fp8KvPrefillRow(4, 4096, 128, causal, 310.0, 320.0, 340.0, 2e-3, 1e-2) for causal in (False, True)]
    table = fp8.markdown([], [], 4000.0, rows)
    lines = table.splitlines()
    assert lines[-2].startswith("| 4 x 4096 | 128 (32/8) | no | 310.0 | 320.0 | 340.0 | 0.94 |")
    assert lines[-1].startswith("| 4 x 4096 | 128 (32/8) | yes |")
    header = next(line for line in lines if line.startswith("| batch x len"))
    assert header.count("|") == lines[-1].count("|")
    assert "Decode" not in table and "fa2, bf16 q over an e4m3 KV cache" in table


def test_flashinfer_is_timed_only_at_the_fp8_dims_its_modules_are_prebuilt_for():
    """At fp8 hd 64, 96 or 192 FlashInfer's first call would JIT-compile its modules (~100 s each) inside
    the run: those rows get a note instead of a peer call; an absent peer needs no note (its reason is
    the run's)."""
    peer, notes = _peers.Peer(object()), []
    assert _peers.timed_peer(peer, 128, notes, fp8.PEER_HEAD_DIMS) is peer and notes == []
    assert _peers.timed_peer(peer, 96, notes, fp8.PEER_HEAD_DIMS) is None
    assert notes == ["FlashInfer not run at hd 96 (timed at hd 128, 256 only)"]
    assert _peers.timed_peer(_peers.Peer(None, "absent"), 96, [], fp8.PEER_HEAD_DIMS) is not None
