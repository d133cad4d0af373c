"""The flash prefill kernel builds for Hopper, with tensor-descriptor loads and with pointers.

The interpreter (where CI runs the kernels) executes a kernel line by line, so code that only
Triton's compiler front end refuses passes there: a ``TMA`` branch that returned early let the
front end build the pointer loads on descriptors, and on an H100 every descriptor launch fell
back to pointers. With descriptors the queries come through one too (a box of 32 tokens x
4 heads). Here the front end builds the kernel's Triton IR for an sm_90 target on the
CPU (no GPU or CUDA toolkit needed), in a child process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Builds ``kernel``'s Triton IR for sm_90 under ``signature`` and ``constants``; a failure
#: prints why and exits 1 (shared by the scripts below).
PRELUDE = textwrap.dedent("""
    import sys

    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({})


    def build(kernel, signature, constants, label):
        signature = {**signature, **{arg: "constexpr" for arg in constants}}
        source = ASTSource(kernel, signature, {(kernel.arg_names.index(arg),): value
                                               for arg, value in constants.items()})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        try:
            source.make_ir(target, options, backend.get_codegen_implementation(options),
                           backend.get_module_map(), context)
        except Exception as exc:
            print(f"FAILED {label}: {type(exc).__name__}: {exc}")
            sys.exit(1)
        print(f"built {label}")
""")

BUILD = PRELUDE + textwrap.dedent("""
    import torch

    from kvtier.engine import paged_triton as pt

    for tma in (True, False):
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            pages = f"tensordesc<{name}[64,128]>" if tma else f"*{name}"
            queries = f"tensordesc<{name}[32,4,128]>" if tma else f"*{name}"
            signature = {"q_ptr": queries, "k_ptr": pages, "v_ptr": pages,
                         "out_ptr": f"*{name}", "table_ptr": "*i32", "blocks_ptr": "*i32",
                         "scale_log2": "fp32"}
            for arg in ("sq_t", "sq_h", "sk_tok", "sk_h", "max_pages", "n_rep", "page_size"):
                signature[arg] = "i32"
            constants = dict(HEAD_DIM=128, BLOCK_M=pt.MAX_ROWS, BLOCK_N=pt.BLOCK_N,
                             CHUNK=pt.CHUNK_TOKENS, PER_CHUNK=pt.CHUNK_TOKENS // pt.BLOCK_N,
                             PAGE_RUN=True, PRECISION=pt.precision_for(dtype), TMA=tma,
                             Q_BOX=32 if tma else 0)
            build(pt.flash_prefill_kernel, signature, constants, f"tma={tma} {name}")
""")

#: The same for ``benchmarks/engine/attention_ceiling.py``'s dense kernel (its descriptor form
#: once failed on an H100 the way the paged kernel's had).
BUILD_CEILING = PRELUDE + textwrap.dedent("""
    import attention_ceiling

    for tma in (True, False):
        tiles = ("tensordesc<bf16[128,128]>", "tensordesc<bf16[64,128]>") if tma \\
            else ("*bf16", "*bf16")
        signature = {"q_src": tiles[0], "k_src": tiles[1], "v_src": tiles[1],
                     "out_ptr": "*bf16", "n_tokens": "i32", "n_rep": "i32",
                     "scale_log2": "fp32"}
        build(attention_ceiling.dense_attention_kernel, signature,
              dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=64, TMA=tma, WS=False), f"tma={tma}")
""")


def _build_for_hopper(script: str, *paths: Path) -> str:
    """Run ``script`` in a child process without the interpreter; its output."""
    triton = pytest.importorskip("triton")
    from triton import backends

    if "nvidia" not in backends.backends:
        pytest.skip(f"this Triton ({triton.__version__}) has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths),
                                                      env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_flash_kernel_builds_for_hopper_with_descriptor_and_pointer_loads():
    assert _build_for_hopper(BUILD, SRC).count("built ") == 4


def test_the_ceiling_benchmarks_dense_kernel_builds_for_hopper():
    out = _build_for_hopper(BUILD_CEILING, SRC, SRC.parent / "benchmarks" / "engine")
    assert out.count("built ") == 2, out
