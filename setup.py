"""The compiled parts of collectives: six optional C/C++ extensions.

Everything else (metadata, dependencies, extras, packages, tool settings)
is in pyproject.toml, which also names NumPy as a build requirement: the
_arraystate extension includes NumPy's headers.
"""

import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def host_ranks_extension(name):
    """One of the C extensions of host ranks (collectives/<name>.c), built
    alike: the shared waits and folds, and -ffp-contract=off, so that float
    folds run exactly as written (no FMA): the bits NumPy gives. Optional:
    without a C compiler the build warns and the package runs the Python
    (NumPy) path each one replaces."""
    return Extension(
        "collectives." + name.replace("/", "."),
        sources=[f"collectives/{name}.c"],
        include_dirs=["collectives/transport", "collectives/executors"],
        depends=["collectives/transport/shm_waits.h", "collectives/transport/statuses.h",
                 "collectives/transport/raised.h", "collectives/transport/signatures.h",
                 "collectives/executors/host_folds.h"],
        extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"],
        optional=True,
    )


# The compiled inner loop of host ranks in separate processes (copy, reduce,
# wait; release/acquire counters); without it, the NumPy interpreter runs every call.
SHMLOOP = host_ranks_extension("transport/_shmloop")
# The compiled send and recv of host ranks in separate processes (p2p.py's
# mailboxes); without it, p2p.py's engine runs every message.
MAILBOX = host_ranks_extension("transport/_mailbox")
# The compiled plan executor of host ranks in separate processes: any plan's
# rows and waits (executors/host_process.py), with the loop's waits and folds.
HOST_PLAN = host_ranks_extension("executors/_host_plan")
# Calls across nodes as compiled Programs (across.py): the node's loop, MPI's
# persistent requests through the functions of the MPI library mpi4py loaded
# (no MPI header: every handle is passed by address), the folds; without it,
# hierarchy.py drives those steps itself.
ACROSS = host_ranks_extension("transport/_across")

# The compression codecs' CPU loops (host ranks), kernels/codec.cuh's
# arithmetic compiled for the CPU; no CUDA header needed. Optional like
# _shmloop: without a C++ compiler the package installs and a compressed call
# on host arrays says how to get one (collectives/compression/kernels.py).
# -ffp-contract=off: no FMA, so every float32 step rounds as on the GPU;
# -fno-trapping-math lets the per-element selects (and avg's division) be
# vectorized; it changes no result, only assumes no one traps on FP flags.
# Three units, the loops for each instruction set (baseline, AVX2, AVX-512),
# compiled side by side (BuildExt).
CODEC = Extension(
    "collectives.compression._codec",
    sources=["collectives/compression/_codec.cpp", "collectives/compression/_codec_avx2.cpp",
             "collectives/compression/_codec_avx512.cpp"],
    include_dirs=["kernels"],
    depends=["collectives/compression/_codec_loops.h", "collectives/compression/_codec_loops_table.h",
             "kernels/codec.cuh", "kernels/emulation/host_math.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math"],
    optional=True,
)

# What a repeated call reads back of NumPy arrays, from the array struct
# (collectives/_arraystate.c): about 1,300 instructions for 8 arrays, against
# 16,000 through their attributes. It needs NumPy's headers, so NumPy is a
# build requirement as well as a runtime one (pyproject.toml's build-system:
# pip puts it in the isolated build environment). Optional like the others: where it fails
# to compile, collectives/arrays.py reads the attributes.
ARRAYSTATE = Extension(
    "collectives._arraystate",
    sources=["collectives/_arraystate.c"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)


def compiling_side_by_side(compile_one_by_one):
    """A compiler's compile(sources, ...) that compiles each source in a
    thread of its own (each runs the compiler as a process): the codec's
    three units are most of an install's build, about 20 CPU-s each."""
    def compile(sources, *arguments, **options):
        with ThreadPoolExecutor(max(len(sources), 1)) as pool:
            compiled = pool.map(lambda source: compile_one_by_one([source], *arguments, **options), sources)
            return [obj for objects in compiled for obj in objects]
    return compile


class BuildExt(build_ext):
    """build_ext, with NumPy's headers for _arraystate, looked up when the
    build runs (the build environment has NumPy by then), and on every core:
    the extensions side by side (build_ext's own -j), and the sources of
    each."""

    def finalize_options(self):
        super().finalize_options()
        import numpy
        for extension in self.extensions:
            if extension.name == ARRAYSTATE.name:
                extension.include_dirs.append(numpy.get_include())
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        self.compiler.compile = compiling_side_by_side(self.compiler.compile)
        super().build_extensions()


# The extensions, and build_ext with NumPy's headers: everything else is in pyproject.toml.
setup(ext_modules=[SHMLOOP, MAILBOX, HOST_PLAN, ACROSS, CODEC, ARRAYSTATE], cmdclass={"build_ext": BuildExt})
