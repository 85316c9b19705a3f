"""collectives: GPU collective operations with our own kernels, NCCL as the yardstick.

The base install needs no GPU package. Extras:
    test    what the test suite needs (pytest, hypothesis, MPI for the multi-process tests)
    mpi     mpi4py with MPICH's wheel, for one rank per process under mpiexec
    cuda12  CuPy, NCCL and numba-cuda built for CUDA 12
    cuda13  the same for CUDA 13
"""

from setuptools import find_packages, setup

MPI = ["mpi4py>=4.0", "mpich>=4.2"]

setup(
    name="collectives",
    version="0.1.0",
    description="Collective operations (allreduce, reduce_scatter, allgather, broadcast, reduce) "
                "on GPU and host arrays, with our own data plane",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["collectives", "collectives.*"]),
    python_requires=">=3.10",
    install_requires=["numpy>=1.24"],
    extras_require={
        "mpi": MPI,
        "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", *MPI],
        "cuda12": ["cupy-cuda12x>=13.3", "nvidia-nccl-cu12>=2.21", "numba-cuda[cu12]>=0.20"],
        "cuda13": ["cupy-cuda13x>=14.0", "nvidia-nccl-cu13>=2.28", "numba-cuda[cu13]>=0.20"],
    },
)
