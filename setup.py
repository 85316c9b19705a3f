"""collectives: GPU collective operations with our own kernels, NCCL as the yardstick.

The base install needs no GPU package and no CUDA toolkit: NumPy and
ml_dtypes, and a C/C++ compiler for the three extensions below (optional: the
package installs without them and says what is missing when it is used).
Extras:
    test    what the test suite needs: pytest, MPI for the
            multi-process tests, and NVIDIA's PyPI wheels of nvcc, ptxas,
            cuobjdump and the CUDA headers, with which the tests build every
            kernel (the codecs' too) for sm_80/sm_90, check it statically,
            and compile it for the CPU (the emulated device); matplotlib and
            PyTorch's CPU build for the plot and Gloo tests. No GPU and no
            CUDA toolkit needed.
    mpi     mpi4py with MPICH's wheel, for one rank per process under mpiexec
    examples  MPI and scikit-learn (the digits data set), for examples/
    bench   matplotlib, for python -m bench.plot
    torch   PyTorch, for the Gloo backend of the benchmarks (torch.distributed);
            the test extra pins the CPU build 2.13.0 (an unpinned torch pulls
            a multi-GB CUDA build)
    cuda12  CuPy, NVRTC, the CUDA headers and NCCL built for CUDA 12
    cuda13  the same for CUDA 13
"""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# The compiled inner loop of host ranks in separate processes (copy, reduce,
# wait; release/acquire counters). Optional: without a C compiler the build
# warns and the package falls back to the NumPy interpreter for every call.
# -ffp-contract=off: float folds exactly as written (no FMA), the bits NumPy gives.
SHMLOOP = Extension(
    "collectives.transport._shmloop",
    sources=["collectives/transport/_shmloop.c"],
    extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"],
    optional=True,
)

# The compression codecs' CPU loops (host ranks), kernels/codec.cuh's
# arithmetic compiled for the CPU; no CUDA header needed. Optional like
# _shmloop: without a C++ compiler the package installs and a compressed call
# on host arrays says how to get one (collectives/compression/kernels.py).
# -ffp-contract=off: no FMA, so every float32 step rounds as on the GPU;
# -fno-trapping-math lets the per-element selects (and avg's division) be
# vectorized; it changes no result, only assumes no one traps on FP flags.
CODEC = Extension(
    "collectives.compression._codec",
    sources=["collectives/compression/_codec.cpp"],
    include_dirs=["kernels"],
    depends=["collectives/compression/_codec_loops.h", "kernels/codec.cuh", "kernels/emulation/host_math.h"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math"],
    optional=True,
)

# What a repeated call reads back of NumPy arrays, from the array struct
# (collectives/_arraystate.c): about 1,300 instructions for 8 arrays, against
# 16,000 through their attributes. It needs NumPy's headers, so NumPy is a
# build requirement as well as a runtime one (setup_requires: pip puts it in
# the isolated build environment). Optional like the others: where it fails
# to compile, collectives/arrays.py reads the attributes.
ARRAYSTATE = Extension(
    "collectives._arraystate",
    sources=["collectives/_arraystate.c"],
    extra_compile_args=["-O2", "-std=c11"],
    optional=True,
)


class BuildExtWithNumpy(build_ext):
    """build_ext, with NumPy's headers for _arraystate, looked up when the
    build runs (setup_requires has installed NumPy by then)."""

    def finalize_options(self):
        super().finalize_options()
        import numpy
        for extension in self.extensions:
            if extension.name == ARRAYSTATE.name:
                extension.include_dirs.append(numpy.get_include())


MPI = ["mpi4py>=4.0", "mpich>=4.2"]
PLOTS = ["matplotlib>=3.7"]   # bench.plot puts the legend "outside", new in 3.7

# The toolchain the kernel build checks run with. Pinned: register counts,
# and so the spill checks, differ between nvcc releases.
CUDA_TOOLCHAIN = [
    "nvidia-cuda-nvcc==13.5.37",
    "nvidia-cuda-crt==13.5.37",
    "nvidia-nvvm==13.5.37",
    "nvidia-cuda-runtime==13.5.37",       # cuda_fp16.h, cuda_bf16.h
    "nvidia-cuda-cccl==13.3.5.0.6",       # <nv/target>, which cuda_fp16.h includes
    "nvidia-cuda-cuobjdump==13.5.37",
    "nvidia-cuda-nvdisasm==13.5.37",      # cuobjdump -sass runs it
    "cmake>=3.25",
]

# The training examples' data set (scikit-learn's digits), and the tests that run them.
EXAMPLES = ["scikit-learn>=1.3"]

setup(
    name="collectives",
    version="0.1.0",
    description="Collective operations (allreduce, reduce_scatter, allgather, broadcast, reduce) "
                "on GPU and host arrays, with our own data plane",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The CUDA sources in kernels/ ship inside the package as
    # collectives/kernel_sources (collectives/kernels.py finds either place).
    packages=find_packages(include=["collectives", "collectives.*"]) + ["collectives.kernel_sources"],
    package_dir={"collectives.kernel_sources": "kernels"},
    package_data={"collectives.kernel_sources": ["*.cu", "*.cuh", "emulation/*.h", "emulation/*.cpp"]},
    ext_modules=[SHMLOOP, CODEC, ARRAYSTATE],
    cmdclass={"build_ext": BuildExtWithNumpy},
    python_requires=">=3.10",
    setup_requires=["numpy>=1.24"],
    install_requires=["numpy>=1.24", "ml_dtypes>=0.4"],
    extras_require={
        "mpi": MPI,
        "test": ["pytest>=8", "pytest-timeout>=2.3", *MPI, *CUDA_TOOLCHAIN, *PLOTS, "torch==2.13.0",
                 *EXAMPLES],
        "bench": PLOTS,
        "examples": [*MPI, *EXAMPLES],
        "torch": ["torch>=2.1"],
        "cuda12": ["cupy-cuda12x>=13.3", "nvidia-cuda-nvrtc-cu12>=12.4", "nvidia-cuda-runtime-cu12>=12.4",
                   "nvidia-nccl-cu12>=2.21"],
        "cuda13": ["cupy-cuda13x>=14.0", "nvidia-cuda-nvrtc>=13.0", "nvidia-cuda-runtime>=13.0",
                   "nvidia-cuda-cccl>=13.0", "nvidia-nccl-cu13>=2.28"],
    },
)
