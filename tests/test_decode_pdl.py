"""The decoder's Triton kernels compiled for an H100/H200 (sm_90 PTX, no GPU needed; with the specializations Triton's
JIT gives them at the 1.5B shape) with and without programmatic dependent launch: each compiles both ways, and under
PDL each waits for the kernel before (``griddepcontrol.wait``) before its first store, and before its first load
except the GEMV's first block of weights (which no kernel of the decode step writes), then lets the next kernel
launch. Without PDL no such instruction is there. The interpreter tests (test_decode_kernels.py) run the kernels'
arithmetic; the GPU tests run PDL against no PDL bit for bit."""

import re

import pytest

from opdkit.engines.decode_kernels import _launch

triton = pytest.importorskip("triton")

BF, F32, I64, I32 = "*bf16", "*fp32", "*i64", "i32"
F64 = "*fp64"

# kernel: (its arguments' types, its constexprs at the 1.5B shape, batch 8)
KERNELS = {
    "gemv_kernel": (dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, out_ptr=BF, part_ptr=F32, B=I32, N=I32, KD=I32, stride_x=I32,
                         stride_w=I32),
                    dict(K_PER=1536, BP=16, BLOCK_N=32, BLOCK_K=64, SPLIT=1, HAS_BIAS=True, SILU=True, IEEE=False,
                         PRE=1)),
    "gemv_reduce_add_norm_kernel": (dict(part_ptr=F32, b_ptr=BF, h_ptr=BF, w_ptr=BF, out_ptr=BF, N=I32, eps="fp32",
                                         stride_h=I32), dict(BP=16, BLOCK=2048, SPLIT=4, HAS_BIAS=False)),
    "gemv_reduce_kernel": (dict(part_ptr=F32, b_ptr=BF, out_ptr=BF, B=I32, N=I32),
                           dict(BP=16, BLOCK_N=64, SPLIT=4, HAS_BIAS=True, SILU=False)),
    "rope_attn_partial_kernel": (dict(qkv_ptr=BF, cos_ptr=BF, sin_ptr=BF, pos_ptr=I64, k_ptr=BF, v_ptr=BF,
                                      start_ptr=I64, end_ptr=I64, end_offset=I32, acc_ptr=F32, m_ptr=F32, l_ptr=F32,
                                      scale="fp32", stride_qkv=I32, stride_cb=I32, stride_ck=I32, stride_cl=I32),
                                 dict(H=12, K=2, G=6, GP=16, D=128, CHUNK=256, BLOCK_N=64, NSPLIT=32, IEEE=False,
                                      STATIC_LOOP=False)),
    "attn_reduce_kernel": (dict(acc_ptr=F32, m_ptr=F32, l_ptr=F32, out_ptr=BF), dict(NSPLIT=32, NSP=32, D=128)),
    "add_rms_norm_kernel": (dict(h_ptr=BF, r_ptr=BF, w_ptr=BF, out_ptr=BF, N=I32, eps="fp32", stride_h=I32,
                                 stride_r=I32), dict(BLOCK=2048)),
    "rms_norm_kernel": (dict(x_ptr=BF, w_ptr=BF, out_ptr=BF, N=I32, eps="fp32", stride_x=I32), dict(BLOCK=2048)),
    "silu_mul_kernel": (dict(gu_ptr=BF, out_ptr=BF, inter=I32, stride_gu=I32), dict(BLOCK=1024)),
    "gumbel_kernel": (dict(raw_ptr=BF, seeds_ptr=I64, t_ptr=I64, tau_ptr=F64, val_ptr=F64, idx_ptr=I64,
                           m_ptr=F32, s_ptr=F32, n_vocab=I32, stride_raw=I32, inv_tau="fp32", skey_ptr=I64,
                           ties_ptr="*i32"), dict(NBLK=149, BLOCK=1024, TEMPERED=True, NUCLEUS=False, NBP=256)),
    "gumbel_kernel/nucleus": (dict(raw_ptr=BF, seeds_ptr=I64, t_ptr=I64, tau_ptr=F64, val_ptr=F64, idx_ptr=I64,
                                   m_ptr=F32, s_ptr=F32, n_vocab=I32, stride_raw=I32, inv_tau="fp32", skey_ptr=I64,
                                   ties_ptr="*i32"), dict(NBLK=149, BLOCK=1024, TEMPERED=True, NUCLEUS=True, NBP=256)),
    "nucleus_hist_kernel": (dict(raw_ptr=BF, tau_ptr=F64, hist_ptr="*i32", bmax_ptr=F64, n_vocab=I32, stride_raw=I32),
                            dict(NBLK=149, BLOCK=1024, TEMPERED=True)),
    "nucleus_mass_kernel": (dict(raw_ptr=BF, tau_ptr=F64, hist_ptr="*i32", bmax_ptr=F64, cmass_ptr=F64,
                                 ccnt_ptr="*i32"), dict(NBLK=149, NBP=256, CH=256, TEMPERED=True)),
    "nucleus_pick_kernel": (dict(raw_ptr=BF, tau_ptr=F64, p_ptr=F64, hist_ptr="*i32", bmax_ptr=F64, cmass_ptr=F64,
                                 ccnt_ptr="*i32", skey_ptr=I64), dict(NBLK=149, NBP=256, CH=256, TEMPERED=True)),
    "nucleus_ties_kernel": (dict(raw_ptr=BF, skey_ptr=I64, ties_ptr="*i32", n_vocab=I32, stride_raw=I32),
                            dict(NBLK=149, BLOCK=1024)),
    "sample_finish_kernel": (dict(raw_ptr=BF, val_ptr="*fp64", idx_ptr=I64, m_ptr=F32, s_ptr=F32, t_ptr=I64,
                                  eos_ptr=I64, n_eos=I32, ids_ptr=I64, logp_ptr=F32, tok_ptr=I64, pos_ptr=I64,
                                  done_ptr="*u8", stride_raw=I32, stride_out=I32, inv_tau="fp32"),
                             dict(NBLK=149, NBP=256, NEP=2, TEMPERED=True)),
}


def _specialized(fn, args: dict) -> dict:
    """The argument attributes Triton's JIT gives a launch at the 1.5B shape: every pointer 16-byte aligned (torch's
    allocations are), the strides and the GEMV's N and KD multiples of 16 (1,536, 2,048, 8,960, ...). Without them the
    loads compile to scalar ones; with them to the vector loads and ``cp.async`` pipelines that run."""
    return {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, ty in args.items()
            if ty.startswith("*") or a.startswith("stride") or a in ("N", "KD")}


def _ptx(name: str, pdl: bool, _options: dict | None = None, **over) -> list[str]:
    """The kernel's PTX instructions (its debug sections and comments dropped), compiled for sm_90 with the kit's
    launch options (``_options`` over them), constexprs ``over`` and the JIT's specializations at the 1.5B shape
    (``_specialized``). A kernel whose arguments no longer match KERNELS fails here (it is not skipped)."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError as e:  # a Triton without ahead-of-time compilation to a target, or without PDL
        pytest.skip(f"this Triton ({triton.__version__}) cannot compile for sm_90 with PDL here: {e}")
    from opdkit.engines import decode_triton

    args, const = KERNELS[name]
    const = {**const, **over, "PDL": pdl}
    fn = getattr(decode_triton, name.split("/")[0])
    src = ASTSource(fn, {**args, **{k: "constexpr" for k in const}}, const, _specialized(fn, args))
    options = {k: v for k, v in _launch(pdl).items() if k != "PDL"}  # as the kit launches it (PDL: a constexpr)
    options.update(_options or {})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **options))
    lines = (re.sub(r"//.*", "", line).strip() for line in kernel.asm["ptx"].split(".section")[0].splitlines())
    return [line for line in lines if line]


def _first(lines: list[str], pattern: str) -> int:
    return next((i for i, line in enumerate(lines) if re.search(pattern, line)), len(lines))


# global-memory loads and stores, predicated or not (shared-memory ones are the program's own)
LOAD = r"^(@!?%p\d+\s+)?(ld\.global|cp\.async\.\S*global)"
STORE = r"^(@!?%p\d+\s+)?(st\.global|red\.global|atom\.global)"


@pytest.mark.parametrize("name", list(KERNELS))
def test_each_kernel_waits_for_the_one_before_under_pdl_and_only_then(name):
    with_pdl, without = _ptx(name, True), _ptx(name, False)
    wait = _first(with_pdl, r"griddepcontrol\.wait")
    assert wait < len(with_pdl) and _first(with_pdl, r"griddepcontrol\.launch_dependents") > wait
    assert wait < _first(with_pdl, STORE) < len(with_pdl)  # nothing written before the kernel before has finished
    if name != "gemv_kernel":
        assert _first(with_pdl, LOAD) > wait  # nothing read before it either
    else:  # the first block of weights (32 gate and 32 up rows x 64 inputs: 8 KB, 4 16-byte loads a thread) is read
        # before the wait, and nothing else (the inputs x of the block would be 4 more)
        assert sum(bool(re.search(LOAD, line)) for line in with_pdl[:wait]) == 4
    assert not any("griddepcontrol" in line for line in without)


def test_the_gemv_loads_its_first_pre_blocks_of_weights_before_the_wait():
    """The q/k/v projection's shape (6 blocks of 16 x 256 weights a program, 8 KB each: 4 16-byte loads a thread):
    with PRE 1 the first block's 4 loads come before the wait, with PRE 6 every block's 24, and none of the inputs'."""
    qkv = dict(K_PER=1536, BLOCK_N=16, BLOCK_K=256, SILU=False)
    before = []
    for pre in (1, 6):
        lines = _ptx("gemv_kernel", True, PRE=pre, **qkv)
        before.append(sum(bool(re.search(LOAD, line)) for line in lines[:_first(lines, r"griddepcontrol\.wait")]))
    assert before == [4, 24], before


def test_the_kernels_contract_multiply_adds_as_they_were_checked():
    """FP fusion is part of the kit's launch (``decode_kernels._launch``), not Triton's default (3.9 warns that 3.10
    turns it off): the rotary kernel's ``x * cos + rot * sin`` compiles to fused multiply-adds, and without it to
    separate multiplies and adds, so the option reaches the compiler and decides the bits."""
    assert _launch(False)["enable_fp_fusion"] is True and _launch(True)["enable_fp_fusion"] is True
    fused = _ptx("rope_attn_partial_kernel", False)
    unfused = _ptx("rope_attn_partial_kernel", False, _options={"enable_fp_fusion": False})
    assert any(re.match(r"fma\.rn\.f32", line) for line in fused)
    assert not any(re.match(r"fma\.rn\.f32", line) for line in unfused)
