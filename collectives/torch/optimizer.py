"""Data-parallel training with PyTorch, in the spirit of Horovod's `DistributedOptimizer`.

    import torch, collectives
    from collectives.torch import DistributedOptimizer, broadcast_parameters

    comm = collectives.init()                        # under mpiexec -n N; device="cuda" for CUDA tensors
    model = Net()
    broadcast_parameters(model, comm, root=0)        # every rank starts from rank 0's weights
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm)
    for x, y in my_shard_of_every_batch:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()              # gradients are averaged while backward runs on
        optimizer.step()                             # waits for the averages, then updates

How it overlaps: `DistributedOptimizer` registers a hook on every parameter
(`register_post_accumulate_grad_hook`). As soon as backward has produced a
parameter's gradient, the hook adds it to the communicator's fusion buffer
(`Communicator.fusion_buffer`), which starts a fused allreduce (op avg) in
the background each time a fusion buffer fills, while backward goes on with
the layers below. `step()` waits for the last one, then runs the wrapped
optimizer on the averaged gradients. Backward produces gradients last layer
first, in the same order on every rank, so every rank fuses the same
gradients into the same buffers and gets the same bits.

Where gradients go: CPU tensors through host ranks (`collectives.init()`),
as NumPy views of the gradients themselves (no copy); CUDA tensors through
GPU ranks (`collectives.init(device="cuda")`), on the stream that produced
them. Gradients are reduced in place.

Needs PyTorch (`pip install '.[torch]'`); `import collectives` does not
import this module.
"""

import threading
import weakref

import numpy as np
import torch

from ..compression import warm_up, wire
from ..errors import InvalidUsageError
from ..fusion import DEFAULT_THRESHOLD
from .tensors import host_array, on_torch_stream

__all__ = ["DistributedOptimizer", "broadcast_parameters"]

# Optimizer methods that register hooks: they act on the wrapped optimizer,
# whose state_dict, load_state_dict and step are the ones that run.
_FORWARDED_HOOK_METHODS = (
    "register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
    "register_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook",
)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer` so that `step()` runs on gradients averaged over `comm`'s ranks.

    optimizer            any torch.optim.Optimizer whose step evaluates its
                         closure at most once (not LBFGS)
    comm                 a communicator with one rank in this process
                         (`collectives.init()` under mpiexec)
    fusion_threshold     bytes per fusion buffer: gradients are packed into
                         buffers of at most this size, each allreduced once
                         as soon as it is full. Smaller buffers start
                         communicating earlier in backward; larger ones pay
                         the fixed cost of a collective fewer times.
    compression          None, "bf16", "fp16" or "int8": what gradients travel
                         as (float32 gradients only; accumulation is float32;
                         the codecs compile, or load from the disk cache,
                         in the constructor)
    error_feedback       keep what compression lost on this rank and add it
                         to the next step's gradient (see FusionBuffer)
    op                   "avg" (the mean gradient, as one process training on
                         the whole global batch would get) or "sum"
    backward_passes_per_step
                         backward passes accumulated locally before the
                         gradients are averaged (gradient accumulation); the
                         last pass's hooks start the communication
    algorithm            the allreduce algorithm ("auto" lets the library pick)

    It is an Optimizer (learning-rate schedulers accept it) that shares the
    wrapped one's `param_groups`, `state` and `defaults`; `state_dict`,
    `load_state_dict`, `add_param_group` and hook registration go to the
    wrapped optimizer. Other attributes are looked up there too.

    Rules, as with Horovod:
    - Every rank runs the same model code, so every rank produces gradients
      for the same parameters in the same order; a parameter that gets no
      gradient in a step (on every rank) is left alone.
    - Between the first backward of a step and `step()` (or `synchronize()`),
      the gradients are the library's: do not read or write them. Gradient
      clipping goes after `synchronize()`: `backward(); synchronize();
      clip_grad_norm_(...); step()` (step does not communicate again).
    - `zero_grad()` in the middle of a step first waits for the gradients in
      flight, then discards them.
    - While gradients are in flight (during backward on host ranks), other
      collectives on `comm` raise InvalidUsageError: call `synchronize()`
      first.
    """

    def __init__(self, optimizer, comm, fusion_threshold=DEFAULT_THRESHOLD, compression=None, error_feedback=False,
                 *, op="avg", backward_passes_per_step=1, algorithm="auto"):
        # Optimizer.__init__ is not called: this object owns no parameters,
        # it shares the wrapped optimizer's (the properties below).
        if isinstance(optimizer, DistributedOptimizer):
            raise InvalidUsageError("optimizer is already a DistributedOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidUsageError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if len(getattr(comm, "local_ranks", ())) != 1:
            raise InvalidUsageError(
                "DistributedOptimizer needs a communicator with one rank in this process: "
                "collectives.init() under mpiexec (one process per rank)")
        passes = backward_passes_per_step
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise InvalidUsageError(f"backward_passes_per_step must be a positive integer, got {passes!r}")
        self.__dict__["_optimizer"] = optimizer   # first: __getattr__ reads it
        self._comm = comm
        # Checks threshold, op, compression and error_feedback before any hook exists.
        self._buffer_settings = dict(threshold=fusion_threshold, op=op, compression=compression,
                                     error_feedback=error_feedback, algorithm=algorithm)
        self._buffer = comm.fusion_buffer(**self._buffer_settings)
        if compression is not None:   # each gradient's dtype, checked now rather than in the middle of backward
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        wire.check_compression(compression, host_array(torch.empty(0, dtype=p.dtype)).dtype, op)
            # Load the codecs' CPU loops now: a package built without them
            # fails here, before training starts, not in its first step.
            warm_up()
        self.backward_passes_per_step = int(passes)
        self._lock = threading.Lock()   # CUDA gradients' hooks run in autograd's device threads
        self._passes = {}               # parameter -> backward passes since the last step
        self._in_flight = False         # gradients were added and not waited for
        self._synchronized = False      # synchronize() ran; step() will not communicate again
        self._copy_back = []            # (gradient, contiguous copy reduced in its place)
        self._streams = set()           # CUDA streams the hooks issued work on
        self._hooked = set()            # ids of the parameters with our hook
        self._handles = []
        weakref.finalize(self, _remove_all, self._handles)
        for group in optimizer.param_groups:
            self._register(group["params"])

    # -- the wrapped optimizer's state, shared ------------------------------------

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._optimizer.param_groups = value

    @property
    def state(self):
        return self._optimizer.state

    @state.setter
    def state(self, value):
        self._optimizer.state = value

    @property
    def defaults(self):
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self._optimizer.defaults = value

    def __getattr__(self, name):
        # Only for names not found on this object (e.g. an optimizer's own attributes).
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self):
        return (f"DistributedOptimizer({self._optimizer!r}, size={self._comm.size}, "
                f"compression={self._buffer.compression!r}, error_feedback={self._buffer.error_feedback})")

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._optimizer.add_param_group(param_group)
        self._register(self._optimizer.param_groups[-1]["params"])

    # -- the training step ------------------------------------------------------------

    def use_communicator(self, comm):
        """Average over `comm` from now on (the communicator shrink() made
        after a failure: collectives.elastic). Gradients in flight on the
        old one are dropped, and with them what error feedback kept."""
        if len(getattr(comm, "local_ranks", ())) != 1:
            raise InvalidUsageError("use_communicator needs a communicator with one rank in this process")
        buffer = comm.fusion_buffer(**self._buffer_settings)
        with self._lock:
            self._comm, self._buffer = comm, buffer
            self._passes.clear()
            self._in_flight = self._synchronized = False
            self._copy_back.clear()
            self._streams = set()

    def synchronize(self):
        """Wait until this step's gradients are averaged over all ranks.

        Starts the allreduce of any gradient whose hook has not run yet
        (a step with fewer backward passes than backward_passes_per_step).
        Raises what the allreduces raised: a CollectiveTimeoutError, or
        RankFailedError when a peer died."""
        with self._lock:
            if self._synchronized:
                return
            try:
                for group in self.param_groups:
                    for p in group["params"]:
                        if 0 < self._passes.get(p, 0) < self.backward_passes_per_step:
                            self._add(p)
                self._wait()
            finally:
                self._passes.clear()
            self._synchronized = True

    def step(self, closure=None):
        """Average the gradients (waiting for the allreduces backward
        started), then run the wrapped optimizer's step. A `closure` is
        evaluated once, before the wait, as SGD or Adam would."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        try:
            self._optimizer.step()
        finally:
            self._synchronized = False
        return loss

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's zero_grad, after any gradient in flight
        has come back (its collectives run on every rank alike)."""
        with self._lock:
            try:
                self._wait()
            finally:
                self._passes.clear()
                self._synchronized = False
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # -- hooks ----------------------------------------------------------------------------

    def remove_hooks(self):
        """Stop averaging gradients: remove the hooks from the parameters
        (before wrapping them in another DistributedOptimizer). Happens by
        itself once this object is garbage."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()

    def _register(self, params):
        # The hooks hold the optimizer weakly: a dropped DistributedOptimizer
        # stops averaging instead of living on in its parameters.
        ref = weakref.ref(self)

        def hook(p):
            optimizer = ref()
            if optimizer is not None:
                optimizer._hook(p)

        for p in params:
            if not p.requires_grad or id(p) in self._hooked:
                continue
            self._hooked.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def _hook(self, p):
        """Runs once backward has accumulated `p`'s gradient into p.grad."""
        with self._lock:
            if self._synchronized:
                raise InvalidUsageError(
                    "backward ran after synchronize() and before step(): the gradients were already averaged; "
                    "call step() (or zero_grad()) first")
            passes = self._passes[p] = self._passes.get(p, 0) + 1
            if passes > self.backward_passes_per_step:
                raise InvalidUsageError(
                    f"a gradient was computed {passes} times since the last step(), with "
                    f"backward_passes_per_step={self.backward_passes_per_step}: call step() after every "
                    "backward, or raise backward_passes_per_step")
            if passes == self.backward_passes_per_step:
                self._add(p)

    def _add(self, p):
        """Give p.grad to the fusion buffer (its allreduce may start at once)."""
        grad = p.grad
        if grad.layout != torch.strided:
            raise InvalidUsageError(f"gradients of layout {grad.layout} are not supported (dense tensors only)")
        contiguous = grad if grad.is_contiguous() else grad.contiguous()
        if contiguous is not grad:
            self._copy_back.append((grad, contiguous))   # reduced in a copy, copied back after the wait
        if grad.device.type == "cpu":
            self._buffer.add(host_array(contiguous))
        elif grad.device.type == "cuda":
            stream = torch.cuda.current_stream(grad.device)
            with on_torch_stream(stream):
                self._buffer.add(contiguous)
            self._streams.add(stream)
        else:
            raise InvalidUsageError(
                f"a gradient is on {grad.device}: CPU tensors go through host ranks (collectives.init()), "
                "CUDA tensors through GPU ranks (collectives.init(device='cuda'))")
        self._in_flight = True

    def _wait(self):
        if not self._in_flight:
            return
        try:
            self._buffer.wait()
        finally:
            self._in_flight = False
            for grad, contiguous in self._copy_back:
                grad.copy_(contiguous)
            self._copy_back.clear()
            streams, self._streams = self._streams, set()
            for stream in streams:   # the optimizer's kernels go after the allreduces
                torch.cuda.current_stream(stream.device).wait_stream(stream)


def _remove_all(handles):
    for handle in handles:
        handle.remove()
    handles.clear()


def _forwarded(name):
    def method(self, *args, **kwargs):
        return getattr(self._optimizer, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped optimizer's {name} (its hooks are the ones that run)."
    return method


for _name in _FORWARDED_HOOK_METHODS:
    setattr(DistributedOptimizer, _name, _forwarded(_name))
del _name


def broadcast_parameters(params, comm, root=0):
    """Make every rank's parameters and buffers equal to the root's, in place.

    `params` is a torch.nn.Module (its state_dict: parameters and persistent
    buffers), a state_dict, or an iterable of tensors or (name, tensor)
    pairs. Every rank passes the same structure. The tensors of one device
    travel as the bytes of one buffer, so it costs one broadcast per device
    whatever the number of tensors. Call it at the start of training, on
    every rank.
    """
    if isinstance(params, torch.nn.Module):
        tensors = list(params.state_dict().values())   # detached, sharing the parameters' memory
    elif isinstance(params, dict):
        tensors = list(params.values())
    else:
        tensors = [item[1] if isinstance(item, tuple) else item for item in params]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise InvalidUsageError(f"broadcast_parameters takes tensors, got {type(t).__name__}")
    by_device = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device in sorted(by_device, key=str):   # the same order on every rank
        _broadcast_bytes(by_device[device], comm, root, device)


def _broadcast_bytes(tensors, comm, root, device):
    """Pack `tensors` as bytes (each on a 16-byte boundary), broadcast, unpack."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 16) * 16
    flat = torch.zeros(total, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            flat[offset:offset + nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        if device.type == "cpu":
            comm.broadcast(flat.numpy(), root=root)
        elif device.type == "cuda":
            with on_torch_stream(torch.cuda.current_stream(device)):
                comm.broadcast(flat, root=root)
        else:
            raise InvalidUsageError(f"tensors on {device} are not supported: CPU or CUDA tensors only")
        for t, offset in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            t.copy_(flat[offset:offset + nbytes].view(t.dtype).view(t.shape))
