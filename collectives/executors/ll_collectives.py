"""The LL path: small calls of the five collectives between GPU ranks in
separate processes as one kernel, kernels/ll_allreduce.cu, with no host in
the loop (docs/device-protocol.md, "The LL one-shot collectives").

Serves: a one-pass plan (paths.py: allreduce, reduce_scatter, allgather,
broadcast or reduce, whose bits are the `direct` plan's, uncompressed) of
at most LL_MAX_RANKS ranks, whose published input fits a rank's LL slot
set (LL_MAX_BYTES, kernels.ll_shape: the message; allgather, the rank's
block; reduce_scatter, all n blocks as whole lines each); on any buffers.

Runs: one launch on the caller's current stream, which returns at once:
no event, no counter, no wait on a peer. The kernel reads the caller's
input and writes its output directly; peers see only each rank's LL area,
in which the kernels count their calls (device_protocol.py has what the
paths with no host in the loop share: the areas, stream order, faults).

The same kernel runs the calls of ranks on several GPUs of one process
(peer_ll.py), with the same rule (`fits`) and the same launch arguments
(`prepare_call`).
"""

from typing import NamedTuple

from .. import kernels
from ..algorithms.schedule import REDUCING_COLLECTIVES
from ..ops import ReduceOp
from ..transport.protocol import describe_call
from .paths import Path, one_pass


def fits(plan):
    """Whether `plan`'s calls run as one LL kernel: a one-pass plan
    (paths.one_pass) of at most LL_MAX_RANKS ranks whose published input
    fits LL_MAX_BYTES."""
    return (one_pass(plan) and plan.nranks <= kernels.LL_MAX_RANKS
            and kernels.ll_shape(plan.collective, plan.nranks, plan.count, plan.dtype.itemsize).fits)


class LLCall(NamedTuple):
    """What every call of a plan passes the kernel (prepare_call)."""
    plan: object
    shape: kernels.LLShape
    instance: kernels.LLInstance
    divisor: int
    signature: int
    description: str


def prepare_call(plan):
    """The LLCall of a plan that `fits`, once per plan."""
    reducing = plan.collective in REDUCING_COLLECTIVES
    op = ReduceOp(plan.op) if reducing else ReduceOp.SUM   # copies: any instance of the dtype does
    return LLCall(plan, kernels.ll_shape(plan.collective, plan.nranks, plan.count, plan.dtype.itemsize),
                  kernels.ll_instance(plan.dtype, op), kernels.step_divisor(op, plan.nranks) if reducing else 0,
                  kernels.ll_signature(plan.count, plan.dtype, ReduceOp(plan.op), plan.collective, plan.root),
                  describe_call(plan))


class LLPath(Path):
    """Small calls as one kernel, for a DeviceProcessRank (see the module doc)."""

    name = "ll"

    def __init__(self, protocol):
        self.protocol = protocol          # device_protocol.DeviceProtocol
        self._args = kernels.LLAllreduceArgs()   # the launch's argument, filled at the first call

    def serves(self, plan):
        return fits(plan)

    def prepare(self, plan, arrays=None):
        return prepare_call(plan)

    def launches(self, plan):
        return 1 if plan.count else 0

    def run(self, route, input_info, output_info, deadline):
        call = route.call
        if call.shape.lines == 0:
            # Nothing to exchange, and no launch: the state words would record 0 lines ("no call before").
            self.protocol.check()
            return
        protocol = self.protocol
        stream = protocol.begin(route.plan.collective, call.description, deadline)
        args = self._args
        if not args.nranks:   # the set-up fields, once the protocol is set up (begin did it)
            args = self._args = protocol.args_copy()
        args.input, args.output, args.count = input_info.address, output_info.address, call.shape.count
        args.collective, args.root, args.signature = call.shape.collective, route.plan.root, call.signature
        args.timeout_ns = protocol.set_timeout(deadline)
        args.divisor = call.divisor
        device = protocol.device
        device.launch_ll_allreduce(stream, call.instance, args)
        device.call_returned()   # protocol.end(), inline: the emulated device runs it now, a GPU keeps it queued
        protocol.check()
