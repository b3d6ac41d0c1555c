"""The one table of validity rules.

Each row says what is wrong with a spec and what to do instead. The generator, the runtime's
backend selection, the CLI (`validate`, `matrix`) and the tests all read this table, so they
cannot disagree. A predicate returns True when the spec VIOLATES the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .spec import Arch, Backend, Kind, KernelSpec, PosEncoding

# Head dims each kernel family is written for, as (qk, vo) pairs. Every family pads a head dim
# between its tile widths up to them in shared memory (fa2/prefill_traits.cuh, fa2/decode_traits.cuh,
# fa3/traits.cuh): the dims below are the common model head dims, each compiled and tested.
HEAD_DIMS = (64, 80, 96, 112, 128, 160, 192, 224, 256)
# The largest head dim a prefill row's fp32 o accumulator leaves room for in one warp's registers.
PREFILL_MAX_HEAD_DIM = 256
# Prefill kernels size Q/K and V/O separately, so any qk >= vo pair of listed dims runs (MLA-like
# (192, 128) among them); a vo wider than qk is refused: no model has one.
HEAD_DIM_PAIRS = frozenset((qk, vo) for qk in HEAD_DIMS for vo in HEAD_DIMS if qk >= vo)
# Wider dims fa2 runs (Gemma's 512): decode spreads a row over two cells a lane; prefill splits o's
# columns over CTAs of 256 each (fa2/prefill_traits.cuh kVOSlices), so o fits as at hd 256.
FA2_WIDE_HEAD_DIMS = frozenset({(512, 512)})
FA2_PREFILL_HEAD_DIMS = HEAD_DIM_PAIRS | FA2_WIDE_HEAD_DIMS
FA3_PREFILL_HEAD_DIMS = HEAD_DIM_PAIRS
# The CUDA-core decode kernel holds one head dim for q, k and v.
DECODE_HEAD_DIMS = frozenset({(d, d) for d in HEAD_DIMS}) | FA2_WIDE_HEAD_DIMS
# Archs whose CTAs get less shared memory (99 KB) than an fa2 hd 512 prefill tile takes (~113 KB).
SMALL_SMEM_ARCHS = frozenset({Arch.SM86, Arch.SM89})
# fa2 prefill with an fp8 cache: one ldmatrix of K covers 32 one-byte dims.
FA2_FP8_KV_PREFILL_HEAD_DIMS = frozenset(dims for dims in FA2_PREFILL_HEAD_DIMS if dims[0] % 32 == 0 and dims[1] % 32 == 0)
# fp8 fa3: qk and vo equal, at these dims only (the ones its GPU tests cover), each in the widest
# swizzle lines that divide its rows (fa3/traits.cuh kTileDimQK/VO).
FA3_FP8_PREFILL_HEAD_DIMS = frozenset({(64, 64), (96, 96), (128, 128), (192, 192), (256, 256)})


def _off_grid(s) -> bool:
    """Head dims that no tile handles but zero-padding to a listed one would: not multiples of 16 (the
    MMAs' k step, whole 16-byte rows) and no wider than the widest listed dim. Wider ones are refused
    by each family's width rule alone, whose advice holds for them (no listed dim to pad to); fa3 fp8,
    which lists its own few dims, by fa3-fp8-head-dims alone."""
    return ((s.head_dim_qk % 16 != 0 or s.head_dim_vo % 16 != 0) and max(s.head_dim_qk, s.head_dim_vo) <= HEAD_DIMS[-1]
            and not _fa3_fp8(s))


def _fa3_fp8(s) -> bool:
    return _fa3(s) and s.dtype_q.is_fp8


def _too_wide(s) -> bool:
    """Wider than 256 and not one of fa2's wide dims (fa3 at those has its own rule, fa3-head-dim-512)."""
    return max(s.head_dim_qk, s.head_dim_vo) > PREFILL_MAX_HEAD_DIM and _dims(s) not in FA2_WIDE_HEAD_DIMS


def _fa3_wide(s) -> bool:
    return _fa3(s) and not s.dtype_q.is_fp8 and _dims(s) in FA2_WIDE_HEAD_DIMS


def _uninstantiated(s, dims: frozenset) -> bool:
    """On the 16-grid and within 256, but not a listed pair: the rules that say why come first."""
    return not _off_grid(s) and not _too_wide(s) and _dims(s) not in dims


@dataclass(frozen=True)
class Rule:
    id: str
    message: str
    suggestion: str
    predicate: Callable[[KernelSpec], bool]

    def violated_by(self, spec: KernelSpec) -> bool:
        return self.predicate(spec)

    def render(self, spec: KernelSpec) -> str:
        return f"[{self.id}] {self.message.format(s=spec)} -> {self.suggestion.format(s=spec)}"


def _fa3(s: KernelSpec) -> bool:
    # fa3 is a prefill family: an fa3 decode spec is refused by decode-is-fa2 alone, so the fa3 rules
    # (whose suggestions assume a prefill kernel) do not pile contradicting advice onto it.
    return s.backend is Backend.FA3 and s.kind is Kind.PREFILL


def _dims(s: KernelSpec) -> tuple[int, int]:
    return (s.head_dim_qk, s.head_dim_vo)


def _pairs(dims: frozenset) -> str:
    """A listed set in words: its equal dims, or every qk >= vo pair of them (no set lists some pairs),
    then fa2's wide dims (512) where the set holds them."""
    wide = sorted(qk for qk, vo in dims & FA2_WIDE_HEAD_DIMS)
    if wide and dims - FA2_WIDE_HEAD_DIMS:
        return _pairs(dims - FA2_WIDE_HEAD_DIMS) + ", and " + ", ".join(map(str, wide))
    equal = sorted(qk for qk, vo in dims if qk == vo)
    if dims == frozenset((qk, vo) for qk in equal for vo in equal if qk >= vo) and len(equal) > 1:
        return "(qk, vo) with qk >= vo, both of " + ", ".join(map(str, equal))
    assert dims == frozenset((d, d) for d in equal), "a head-dim set is its equal pairs or all qk >= vo pairs of them"
    return ", ".join(map(str, equal))


RULES: tuple[Rule, ...] = (
    Rule(
        "o-not-fp8",
        "the output dtype is {s.dtype_o.short}; no kernel writes an fp8 output",
        "use o_data_type bf16 or fp16",
        lambda s: s.dtype_o.is_fp8,
    ),
    Rule(
        "no-archs",
        "the spec names no target arch",
        "name at least one of sm80, sm86, sm89, sm90, sm90a",
        lambda s: not s.archs,
    ),
    Rule(
        "mixed-16bit-qkv",
        "q is {s.dtype_q.short} and kv is {s.dtype_kv.short}: mixed 16-bit q/kv is not supported",
        "store the KV cache in the query's dtype ({s.dtype_q.short})",
        lambda s: not s.dtype_q.is_fp8 and not s.dtype_kv.is_fp8 and s.dtype_q is not s.dtype_kv,
    ),
    Rule(
        "fp8-q-needs-fp8-kv",
        "q is {s.dtype_q.short} but kv is {s.dtype_kv.short}: an fp8 query needs an fp8 KV cache",
        "quantize the KV cache to {s.dtype_q.short}, or use a 16-bit query",
        lambda s: s.dtype_q.is_fp8 and not s.dtype_kv.is_fp8,
    ),
    Rule(
        "fa2-no-fp8-q",
        "fa2 kernels take a 16-bit query; q is {s.dtype_q.short}",
        "use a bf16/fp16 query with fa2 (fp8 KV is dequantized in the kernel), or an fp8 KV cache and backend fa3 "
        "on sm90a (prefill, or decode with use_tensor_cores=True)",
        lambda s: s.backend is Backend.FA2 and s.dtype_q.is_fp8,
    ),
    Rule(
        "fa3-needs-sm90a",
        "fa3 kernels use wgmma/TMA/setmaxnreg, which only sm_90a has; archs are {s.arch_list}",
        "target sm90a alone, or use backend fa2 for these archs",
        lambda s: _fa3(s) and Arch.SM90A not in s.archs,
    ),
    Rule(
        "fa3-only-sm90a",
        "an fa3 module is Hopper-only but also targets {s.arch_list}",
        "build fa3 for sm90a alone and fa2 for the other archs",
        lambda s: _fa3(s) and Arch.SM90A in s.archs and any(a is not Arch.SM90A for a in s.archs),
    ),
    Rule(
        "fa3-fp8-kv-needs-fp8-q",
        "fa3 with an fp8 KV cache needs an fp8 query (the fp8 wgmma takes both operands fp8); q is {s.dtype_q.short}",
        "use backend fa2, which dequantizes fp8 KV in the kernel, or quantize the query to {s.dtype_kv.short}",
        lambda s: _fa3(s) and s.dtype_kv.is_fp8 and not s.dtype_q.is_fp8,
    ),
    Rule(
        "fa3-same-dtype-family",
        "fa3 fp8 needs q and kv of the same fp8 format; q is {s.dtype_q.short}, kv is {s.dtype_kv.short}",
        "use the same dtype for q and kv, or backend fa2",
        lambda s: _fa3(s) and s.dtype_q.is_fp8 and s.dtype_kv.is_fp8 and s.dtype_q is not s.dtype_kv,
    ),
    Rule(
        "fa3-no-custom-mask",
        "fa3 kernels have no custom-mask path",
        "use backend fa2 for custom masks",
        lambda s: _fa3(s) and s.use_custom_mask,
    ),
    Rule(
        "fa3-no-pos-encoding",
        "fa3 kernels have no in-kernel positional encoding; pos_encoding is {s.pos_encoding.value}",
        "apply RoPE before the kernel and use pos_encoding NONE, or backend fa2",
        lambda s: _fa3(s) and s.pos_encoding is not PosEncoding.NONE,
    ),
    Rule(
        "no-fp16-qk-reduction",
        "every kernel accumulates q.k in fp32; none has an fp16 reduction path",
        "turn fp16_qk_reduction off (fp32 accumulation is as fast on sm80+ tensor cores)",
        lambda s: s.fp16_qk_reduction,
    ),
    Rule(
        "head-dims-multiple-of-16",
        "head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo}) are not multiples of 16, the MMAs' k step and the "
        "16-byte vector of every load",
        "zero-pad q, k and v to the next of " + ", ".join(map(str, HEAD_DIMS))
        + " (zero columns add nothing to q.k) and drop the output's padding columns",
        lambda s: _off_grid(s),
    ),
    Rule(
        "prefill-head-dims-max-256",
        "{s.backend.value} {s.kind.value} has no kernel above head dim " + str(PREFILL_MAX_HEAD_DIM)
        + " but 512 (qk {s.head_dim_qk}, vo {s.head_dim_vo}): a row's fp32 o accumulator would not fit the registers",
        "use head dims up to " + str(PREFILL_MAX_HEAD_DIM) + " or 512 (fa2), e.g. split the head into two of half the size",
        lambda s: s.kind is Kind.PREFILL and _too_wide(s) and not _fa3_fp8(s),
    ),
    Rule(
        "fa3-head-dims",
        "fa3 has no 16-bit kernel for head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo})",
        "use head dims " + _pairs(FA3_PREFILL_HEAD_DIMS) + " or backend fa2",
        lambda s: _fa3(s) and not s.dtype_q.is_fp8 and not _fa3_wide(s) and _uninstantiated(s, FA3_PREFILL_HEAD_DIMS),
    ),
    Rule(
        "fa3-head-dim-512",
        "fa3 has no kernel for head dim 512: a consumer warpgroup's fp32 o accumulator for 64 rows x 512 "
        "columns would take 256 registers a thread, and fa3 does not split o's columns over CTAs",
        "use backend fa2, whose prefill splits o into two 256-column halves (one CTA each)",
        lambda s: _fa3_wide(s),
    ),
    Rule(
        "fa2-prefill-head-dims",
        "fa2 prefill has no kernel for head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo})",
        "use head dims " + _pairs(FA2_PREFILL_HEAD_DIMS),
        lambda s: (s.kind is Kind.PREFILL and s.backend is Backend.FA2
                   and _uninstantiated(s, FA2_PREFILL_HEAD_DIMS)),
    ),
    Rule(
        "fa2-fp8-kv-head-dims",
        "fa2 prefill with an fp8 KV cache reads K and V in 32-dim steps (one ldmatrix of 16-byte rows); "
        "head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo}) are not multiples of 32",
        "use head dims " + _pairs(FA2_FP8_KV_PREFILL_HEAD_DIMS) + ", or a 16-bit KV cache",
        lambda s: (s.kind is Kind.PREFILL and s.backend is Backend.FA2 and s.dtype_kv.is_fp8
                   and _dims(s) in FA2_PREFILL_HEAD_DIMS and _dims(s) not in FA2_FP8_KV_PREFILL_HEAD_DIMS),
    ),
    Rule(
        "fa2-head-dim-512-smem",
        "fa2 prefill at head dim 512 keeps a 512-wide Q and K tile in shared memory (~113 KB a CTA), more than "
        "the 99 KB a CTA gets on sm86 and sm89; archs are {s.arch_list}",
        "target sm80 or sm90/sm90a (163 KB and 227 KB a CTA), or use head dims up to 256",
        lambda s: (s.kind is Kind.PREFILL and s.backend is Backend.FA2 and _dims(s) in FA2_WIDE_HEAD_DIMS
                   and any(a in SMALL_SMEM_ARCHS for a in s.archs)),
    ),
    Rule(
        "decode-is-fa2",
        "the CUDA-core decode kernels are fa2 kernels; fa3 serves decode through its prefill kernels",
        "use backend fa2 for kind decode, or decode with use_tensor_cores=True to run on fa3",
        lambda s: s.kind is Kind.DECODE and s.backend is Backend.FA3,
    ),
    Rule(
        "decode-head-dims",
        "the decode kernel has no instance for head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo})",
        "use head dim " + _pairs(DECODE_HEAD_DIMS) + " (qk and vo equal), or use_tensor_cores=True, whose prefill "
        "kernels take (qk, vo) pairs",
        lambda s: s.kind is Kind.DECODE and not _off_grid(s) and _dims(s) not in DECODE_HEAD_DIMS,
    ),
    Rule(
        "decode-no-custom-mask",
        "decode attends to the whole (windowed) KV of its request; it has no custom mask",
        "turn use_custom_mask off for decode, or use a prefill kernel",
        lambda s: s.kind is Kind.DECODE and s.use_custom_mask,
    ),
    Rule(
        "fa3-fp8-head-dims",
        "fa3 fp8 has no kernel for head dims (qk {s.head_dim_qk}, vo {s.head_dim_vo}): it runs equal qk and vo, "
        "at the listed dims only",
        "use head dims " + _pairs(FA3_FP8_PREFILL_HEAD_DIMS) + ", or a 16-bit query and KV cache",
        lambda s: _fa3(s) and s.dtype_q.is_fp8 and _dims(s) not in FA3_FP8_PREFILL_HEAD_DIMS,
    ),
)

RULES_BY_ID = {rule.id: rule for rule in RULES}
assert len(RULES_BY_ID) == len(RULES), "rule ids must be unique"


def check(spec: KernelSpec) -> list[Rule]:
    """Every rule the spec violates (empty list: the spec is valid)."""
    return [rule for rule in RULES if rule.violated_by(spec)]


class UnsupportedSpecError(ValueError):
    """A spec that some rule refuses; carries every violated rule."""

    def __init__(self, spec: KernelSpec, violations: list[Rule]):
        self.spec = spec
        self.violations = violations
        lines = "\n  ".join(rule.render(spec) for rule in violations)
        super().__init__(f"unsupported kernel spec {spec.name}:\n  {lines}")

    @property
    def rule_ids(self) -> list[str]:
        return [rule.id for rule in self.violations]


def ensure_valid(spec: KernelSpec) -> KernelSpec:
    violations = check(spec)
    if violations:
        raise UnsupportedSpecError(spec, violations)
    return spec
