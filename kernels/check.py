"""Build every kernel with nvcc (CMakeLists.txt) and check what ptxas and the SASS say.

    python kernels/check.py [--build-dir build/kernels] [--json report.json]

Works without a GPU: nvcc, ptxas and cuobjdump come from NVIDIA's PyPI wheels
(the `test` extra) or a CUDA toolkit on the PATH. Prints registers per thread
of every kernel on every architecture, and fails (exit 1) when

* a kernel spills registers or has a stack frame (local memory), by ptxas's
  resource usage, or its SASS touches local memory (LDL/STL);
* a kernel that must be in the build is not (VECTOR_KERNELS);
* the vector path of a kernel in VECTOR_KERNELS is not the wide global
  accesses it is written for on sm_80 and sm_90 (wanted_accesses): 128-bit
  loads and stores (LDG.E.128, STG.E.128) of plan_step, batched_copy, the
  LL lines of ll_allreduce and the codecs' float32 side (codec_kernel,
  codec_batch, which runs all of them, and codec_round_sum), 64-bit (LDG.E.64, STG.E.64) of the
  codecs' 16-bit payloads; or any access goes through a
  generic LD/ST instead of a global one;
* a float operation of the PTX flushes subnormals (.ftz), or fuses a
  multiply and an add (fma/mad on floats: one rounding instead of two), either
  of which would change results against NumPy. (The SASS of correctly rounded division
  uses .FTZ compares and adds internally; the PTX is what we wrote.)
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VECTOR_ARCHS = ("sm_80", "sm_90")  # where 16-byte paths must be 128-bit accesses
# Kernels (names as they appear in mangled symbols) that instances.cu must
# build and whose vector paths must compile to wide global accesses
# (ll_allreduce: an LL line is one 16-byte store and one 16-byte load).
VECTOR_KERNELS = ("plan_step", "batched_copy", "codec_kernel", "codec_batch", "codec_round_sum", "ll_allreduce")
CODEC_NAMES = ("bf16", "fp16", "int8")                 # kernels/codec.cuh: enum Codec
CODEC_OPS = ("encode", "decode", "decode_add", "add")  # kernels/codec.cu: enum CodecOp
_CODEC_KERNEL = re.compile(r"12codec_kernelILi(\d)ELi(\d)E")
_CODEC_BATCH = re.compile(r"11codec_batchILi(\d)EE")
_CODEC_ROUND_SUM = re.compile(r"15codec_round_sumILi(\d)EE")

_FUNCTION = re.compile(r"Function properties for (\S+)")
_COMPILING = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SASS_ARCH = re.compile(r"code for (sm_\d+)")
_SASS_FUNCTION = re.compile(r"Function : (\S+)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_GENERIC_ACCESS = re.compile(r"^(LD|ST)\.")          # LD.E, ST.E.128: generic address space
_PTX_ENTRY = re.compile(r"\.entry (\S+)\(")


def find_tool(name):
    """A CUDA tool from the NVIDIA wheels (site-packages/nvidia/cu*/bin), else the PATH."""
    try:
        import nvidia
        for root in map(Path, nvidia.__path__):
            for candidate in sorted(root.glob(f"cu*/bin/{name}")):
                if os.access(candidate, os.X_OK):
                    return str(candidate)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: pip install '.[test]' brings NVIDIA's wheels of it")
    return found


def build(build_dir):
    """Configure and build CMakeLists.txt; returns the build directory."""
    cmake = shutil.which("cmake") or str(Path(sys.executable).with_name("cmake"))
    build_dir = Path(build_dir)
    run([cmake, "-S", str(ROOT), "-B", str(build_dir), f"-DNVCC={find_tool('nvcc')}"])
    run([cmake, "--build", str(build_dir)])
    return build_dir


def run(command):
    # The wheels' tools find each other (cuobjdump runs nvdisasm) on the PATH.
    path = os.pathsep.join([str(Path(command[0]).parent), os.environ.get("PATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, PATH=path))
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def resource_usage(text):
    """{(kernel, arch): {registers, stack, spill_stores, spill_loads}} from ptxas -v."""
    usage, arch, function = {}, None, None
    for line in text.splitlines():
        if m := _COMPILING.search(line):
            arch = m[2]
        elif m := _FUNCTION.search(line):
            function = m[1]
        elif (m := _FRAME.search(line)) and function:
            usage[function, arch] = {"stack": int(m[1]), "spill_stores": int(m[2]), "spill_loads": int(m[3])}
        elif (m := _REGISTERS.search(line)) and function and (function, arch) in usage:
            usage[function, arch]["registers"] = int(m[1])
            function = None
    return usage


def sass_instructions(text):
    """{(kernel, arch): [opcode with modifiers, ...]} from cuobjdump -sass."""
    code, arch, function = defaultdict(list), None, None
    for line in text.splitlines():
        if m := _SASS_ARCH.search(line):
            arch = m[1]
        elif m := _SASS_FUNCTION.search(line):
            function = m[1]
        elif (m := _INSTRUCTION.search(line)) and function:
            code[function, arch].append(m[1])
    return dict(code)


def ptx_flushing(text):
    """{kernel: [PTX lines with .ftz]} from cuobjdump -ptx."""
    flushing, kernel = defaultdict(list), None
    for line in text.splitlines():
        if m := _PTX_ENTRY.search(line):
            kernel = m[1]
        elif kernel and ".ftz" in line:
            flushing[kernel].append(line.strip())
    return dict(flushing)


_PTX_FUSED = re.compile(r"^\s*(?:@!?%p\w+\s+)?(?:fma|mad)\.[\w.]*f(?:16|32|64)\b")


def ptx_fused(text):
    """{kernel: [PTX lines with a fused float multiply-add]} from cuobjdump -ptx."""
    fused, kernel = defaultdict(list), None
    for line in text.splitlines():
        if m := _PTX_ENTRY.search(line):
            kernel = m[1]
        elif kernel and _PTX_FUSED.match(line):
            fused[kernel].append(line.strip())
    return dict(fused)


def problems(usage, code, flushing, fused=None):
    found = [f"{short(kernel)} (PTX): flushes subnormals: {lines[:3]}" for kernel, lines in sorted(flushing.items())]
    found += [f"{short(kernel)} (PTX): fused multiply-adds: {lines[:3]}"
              for kernel, lines in sorted((fused or {}).items())]
    if not usage:
        found.append("ptxas reported no kernels")
    for (kernel, arch), u in sorted(usage.items()):
        if u["stack"] or u["spill_stores"] or u["spill_loads"]:
            found.append(f"{short(kernel)} on {arch}: {u['stack']} bytes stack, {u['spill_stores']} bytes spill "
                         f"stores, {u['spill_loads']} bytes spill loads")
    for (kernel, arch), opcodes in sorted(code.items()):
        name = f"{short(kernel)} on {arch}"
        local = sorted({o for o in opcodes if o.startswith(("LDL", "STL"))})
        if local:
            found.append(f"{name}: local memory accesses {local}")
        generic = sorted({o for o in opcodes if _GENERIC_ACCESS.match(o)})
        if generic:
            found.append(f"{name}: generic (not global) accesses {generic}")
        if arch in VECTOR_ARCHS and any(vector in kernel for vector in VECTOR_KERNELS):
            for wanted in wanted_accesses(kernel):
                if not any(o == wanted or o.startswith(wanted + ".") for o in opcodes):
                    found.append(f"{name}: no {wanted} (its vector path)")
    for wanted_arch in VECTOR_ARCHS:
        if not any(arch == wanted_arch for _, arch in code):
            found.append(f"no {wanted_arch} code in the build")
    for vector in VECTOR_KERNELS:
        if not any(vector in kernel for kernel, _ in usage):
            found.append(f"no {vector} kernel in the build")
    return found


def wanted_accesses(kernel):
    """The wide global accesses the vector path of `kernel` (a mangled name)
    must compile to. The codecs: 8 lanes of a block of 32 elements move one
    float4 each (LDG.E.128 where float32 is read: all but decode; STG.E.128
    where it is written: all, encode when it rounds x), and 8 bytes of a
    16-bit payload (LDG.E.64 where decode and decode_add read it, STG.E.64
    where encode, decode_add and add write it); int8's 4 bytes per lane are
    plain 32-bit LDG.E/STG.E, which every kernel has anyway."""
    if m := _CODEC_BATCH.search(kernel):   # every op's accesses, in one kernel
        return tuple(sorted({a for op in range(len(CODEC_OPS)) for a in
                             wanted_accesses(f"12codec_kernelILi{m[1]}ELi{op}E")}))
    m = _CODEC_KERNEL.search(kernel)
    if not m:
        return ("LDG.E.128", "STG.E.128")
    codec, op = CODEC_NAMES[int(m[1])], CODEC_OPS[int(m[2])]
    wanted = ["STG.E.128"] + (["LDG.E.128"] if op != "decode" else [])
    if codec != "int8":
        wanted += ["LDG.E.64"] if op in ("decode", "decode_add") else []
        wanted += ["STG.E.64"] if op != "decode" else []
    return tuple(wanted)


_INTEGERS = {"a": "Int8", "s": "Int16", "i": "Int32", "x": "Int64",
             "h": "Uint8", "t": "Uint16", "j": "Uint32", "y": "Uint64"}


def short(kernel):
    """plan_step<Int8, 0> for the mangled name of plan_step<Integer<signed char, ...>, 0>;
    batched_copy for batched_copy's."""
    if re.search(r"\d+batched_copyE", kernel):
        return "batched_copy"
    if m := _CODEC_KERNEL.search(kernel):
        return f"codec_kernel<{CODEC_NAMES[int(m[1])]}, {CODEC_OPS[int(m[2])]}>"
    if m := _CODEC_BATCH.search(kernel):
        return f"codec_batch<{CODEC_NAMES[int(m[1])]}>"
    if m := _CODEC_ROUND_SUM.search(kernel):
        return f"codec_round_sum<{CODEC_NAMES[int(m[1])]}>"
    m = re.search(r"plan_stepINS_\d+(\w+?)(?:I(\w+?)E)?ELi(\d)E", kernel)
    if not m:
        return kernel
    element, arguments = m[1], m[2] or ""
    if element == "Integer":
        element = _INTEGERS.get(arguments[:1], element)
    elif element == "IeeeFloat":
        element = {"f": "Float32", "d": "Float64"}.get(arguments, element)
    elif element == "Float16Like":
        element = "BFloat16" if "BFloat16" in arguments else "Float16"
    return f"plan_step<{element}, {m[3]}>"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python kernels/check.py", description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", default=str(ROOT / "build" / "kernels"))
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    build_dir = build(args.build_dir)
    usage = resource_usage((build_dir / "kernels.resource-usage.txt").read_text())
    fatbin = str(build_dir / "kernels.fatbin")
    code = sass_instructions(run([find_tool("cuobjdump"), "-sass", fatbin]))
    ptx = run([find_tool("cuobjdump"), "-ptx", fatbin])
    flushing, fused = ptx_flushing(ptx), ptx_fused(ptx)
    archs = sorted({arch for _, arch in usage})
    print(f"# registers per thread ({', '.join(archs)}), from ptxas; nvcc {find_tool('nvcc')}")
    for kernel in sorted({k for k, _ in usage}, key=short):
        print(f"{short(kernel):30s} " + "  ".join(f"{usage[kernel, a].get('registers', '?'):>4}" for a in archs))
    found = problems(usage, code, flushing, fused)
    for problem in found:
        print(f"FAIL {problem}")
    print(f"# {len(usage)} kernel builds checked: " + ("all clean" if not found else f"{len(found)} problems"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "kernels": [{"kernel": short(k), "arch": a, **u} for (k, a), u in sorted(usage.items())],
            "problems": found}, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
