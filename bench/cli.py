"""What every bench command line shares: --help that shows the defaults, and
errors (a bad flag, a missing toolchain) that fit on one line, with no
traceback, since a newcomer's first run should end in a sentence, not a stack."""

import argparse
import json
import sys
import textwrap
from pathlib import Path

from collectives.errors import CollectiveError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help already says
    its default or there is none worth showing (None, or a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default is argparse.SUPPRESS \
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with the formatter above and a one-line error: argparse's own
    prints the whole usage first, which for the benchmarks is a screenful."""

    def __init__(self, prog, description, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        if description and "\n" not in description:  # the raw formatter would not wrap it
            description = textwrap.fill(description, 79)
        super().__init__(prog=prog, description=description, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_size(text):
    """A byte or element count: a number with an optional suffix K, M or G
    (powers of 1024), as nccl-tests takes them: 64M, 1.5K, 4096."""
    text = str(text).strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def size_label(nbytes):
    """A byte count as a table shows it, parse_size's inverse for whole
    units: 64 MiB, 1 KiB, 1000 B (a count that is no whole unit stays in B)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_sweep(first, last, factor):
    """The sizes of a sweep, as nccl-tests' -b, -e and -f give them: from
    `first` to at most `last` (either as parse_size takes it), each `factor`
    times the one before; empty where `first` is above `last`."""
    sweep, size, last = [], parse_size(first), parse_size(last)
    while size <= last:
        sweep.append(size)
        size *= factor
    return sweep


def size(text):
    """An argparse type for a byte or element count with an optional suffix
    K, M or G (parse_size's syntax): checks it and returns the text as given,
    so the tool parses it where it always did, and a bad one is a one-line
    usage error instead of a ValueError traceback."""
    try:
        parse_size(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number with an optional suffix K, M or G")
    return text


def sizes(text):
    """Comma-separated sizes, each as `size` takes it; returns the text."""
    for item in str(text).split(","):
        if item.strip():
            size(item)
    return text


def names(parser, flag, text, known):
    """The comma-separated names of `flag`, in order, each once; a name not in
    `known`, or none at all, is a one-line usage error naming the flag."""
    given = list(dict.fromkeys(name.strip() for name in str(text).split(",") if name.strip()))
    unknown = [name for name in given if name not in known]
    if unknown or not given:
        parser.error(f"{flag}: unknown {unknown}; choose from {', '.join(known)}")
    return given


def write_json(path, report, say=print):
    """Write a tool's JSON to `path`, where its -J told it to (no tool writes
    anywhere else), making the folder if need be; every tool's file has the
    same layout (indent 1, a final newline). `say` names the file after
    (None: not, where the tool's stdout is itself the result)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    if say is not None:
        say(f"# wrote {path}")


def fail(prog, message, code=1):
    """Ends the program with `prog: error: message` on one line of stderr."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    sys.exit(code)


def require_device_toolchain(prog, device):
    """Stops with one line when `device` needs what is not installed: the
    emulated device compiles our CUDA sources with g++ against the CUDA
    headers; a GPU needs CuPy (which may bring its own toolkit's headers, so
    those are left to the device). Checked before any rank starts, so the
    error comes once, not once per rank under mpiexec after a traceback."""
    kind = str(device).split(":")[0]
    if kind == "cuda":
        try:
            import cupy  # noqa: F401
        except ImportError as error:
            fail(prog, f"--device cuda needs CuPy ({error}): pip install -e '.[cuda13]' in a checkout, "
                       f"or pip install 'collectives[cuda13]'")
    elif kind == "emulated":
        from collectives import kernels
        from collectives.devices import emulated
        try:
            emulated.compiler()
            kernels.cuda_include_dirs()
        except CollectiveError as error:
            fail(prog, f"--device {device}: {error}")
