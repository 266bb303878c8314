"""The instruction mix of a kernel's loops as compiled for an H100 (sm_90), no GPU needed.

What a kernel change does to the work of its inner loops can be read before a GPU times it: the
launch is recorded from the op's own launcher on CPU tensors and compiled with Triton's compiler
and bundled ptxas exactly as `tools/compile_check.py` does, then disassembled with the bundled
cuobjdump. Each loop (a backward branch) is reported with its instructions per iteration by opcode,
and the kernel with its registers and spills a thread:

    python -m tools.sass_loops attention_fwd [--head-dim 128] [--tma] [--causal] [--config 128,64,8,3] [--json]

Kernels: attention_fwd, attention_dkdv, attention_dq (bf16, B=2, L=4096, 8 heads; no lengths, no
dropout, so the first loop of each is the unmasked one). --config is BLOCK_M,BLOCK_N,num_warps,
num_stages (the default is the forward's tuned pick at head dim 128 on an H100). A count is static
(instructions in the loop body, each issued once an iteration), not a timing.

Used in the attention forward's change to one FMA per score (2026-11-28): its unmasked loop went
from 351 to 321 instructions (FMUL 96 -> 66) at head dim 128, 128 x 64 tiles, 8 warps, TMA.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tools import compile_check as cc  # noqa: E402

KERNELS = {"attention_fwd": 0, "attention_dkdv": 2, "attention_dq": 3}  # their order among the recorded launches


def record_attention(head_dim: int, tma: bool, causal: bool) -> list:
    """The attention forward's and backward's launches (compile_check's records), bf16, L 4096."""
    from scratchformer.kernels import attention as A

    cc._CAPTURE.update(op="attention", launches=[])
    saved, A.TMA = A.TMA, tma
    try:
        with cc.capture([A]), cc.scenario("sass", "bf16"):
            x = torch.empty(2, 4096, 3, 8, head_dim, dtype=torch.bfloat16)  # the model's fused projection
            q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
            out, lse = A.attention_fwd(q, k, v, None, None, causal, 0.0, None, None)
            A.attention_bwd(torch.empty_like(out), q, k, v, out, lse, None, None, causal, 0.0, None, None)
    finally:
        A.TMA = saved
    return cc._CAPTURE["launches"]


def sass(launch, config: tuple[int, int, int, int], target: str = "sm90") -> tuple[str, dict]:
    """The launch compiled with config (BLOCK_M, BLOCK_N, num_warps, num_stages): its disassembly,
    and its registers and spills a thread (`compile_check._resources`)."""
    bm, bn, warps, stages = config
    kw = {**cc._config_kwargs(launch, None), "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    backend, options, sig, consts, attrs = cc._bind(launch.kernel, launch.args, kw, cc.TARGETS[target][0])
    kernel = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=cc.TARGETS[target][0],
                            options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cc._cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return text, cc._resources(kernel.asm["cubin"])


_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(?:0x([0-9a-f]+))?\s*;")


def loops(text: str, min_count: int = 8) -> list[dict]:
    """The innermost loops of a disassembly in address order, each {start, end, count, ops}: ops
    counts the body's instructions by opcode (modifiers dropped). A loop is a backward branch of at
    least min_count instructions (shorter ones are spin waits on a barrier, placed out of line);
    a branch whose span holds another loop's end (a jump back from a kernel's tail) is left out."""
    instrs = [(int(a, 16), op, target) for a, op, target in _INSTR.findall(text)]
    spans = []
    for addr, op, target in instrs:
        if op == "BRA" and target and int(target, 16) < addr:
            body = collections.Counter(o for a, o, _ in instrs if int(target, 16) <= a <= addr)
            if sum(body.values()) >= min_count:
                spans.append({"start": int(target, 16), "end": addr, "count": sum(body.values()), "ops": dict(body)})
    return sorted((span for span in spans if not any(span["start"] <= other["end"] < span["end"] for other in spans)),
                  key=lambda span: span["start"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", choices=list(KERNELS))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tma", action="store_true", help="stream blocks through tensor descriptors")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--config", default="128,64,8,3", help="BLOCK_M,BLOCK_N,num_warps,num_stages")
    p.add_argument("--json", action="store_true", help="print the loops as JSON")
    args = p.parse_args(argv)
    config = tuple(int(x) for x in args.config.split(","))
    launch = record_attention(args.head_dim, args.tma, args.causal)[KERNELS[args.kernel]]
    text, resources = sass(launch, config)
    found = loops(text)
    if args.json:
        print(json.dumps({"resources": resources, "loops": found}))
        return 0
    print(f"{args.kernel}: head dim {args.head_dim}, TMA {args.tma}, causal {args.causal}, config {config}, "
          f"sm_90, Triton {triton.__version__}; a thread's registers {resources.get('regs')}, "
          f"stack (spills) {resources.get('stack')} B")
    for loop in found:
        top = sorted(loop["ops"].items(), key=lambda t: -t[1])[:12]
        print(f"loop {loop['start']:#x}-{loop['end']:#x}: {loop['count']} instructions; "
              + ", ".join(f"{op} {n}" for op, n in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
