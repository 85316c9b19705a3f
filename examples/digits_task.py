"""What the PyTorch examples share: scikit-learn's handwritten digits as
tensors (digits_data.py reads them), the MLP they train on them, and
starting a torch.distributed process group.

The examples import it as a sibling module: run them as scripts
(`python examples/torch_mlp.py`, `torchrun ... examples/ddp.py`).
"""

import os
import time

import torch
import torch.distributed as dist

import digits_data


def digits(seed=0):
    """(x_train, y_train, x_test, y_test) as tensors: 1197 training and 600 test images."""
    return tuple(torch.from_numpy(array) for array in digits_data.digits(seed))


def mlp(sizes):
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def start(backend):
    """init_process_group for `backend` ("gloo", "collectives" or "nccl");
    the device this rank's tensors live on."""
    if backend == "collectives":
        import collectives.torch  # noqa: F401 - registers the "collectives" backend
    dist.init_process_group(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def let_go(tensors, seconds=10.0):
    """Return once Gloo's worker threads have let go of `tensors`, the last
    ones a collective of this rank used, or after `seconds`.

    A collective's call returns when its worker thread has filled the
    tensors; the thread drops its hold on them afterwards, and with torch
    2.13 it needs the GIL to drop a tensor Python also holds. If it gets
    there after the interpreter began to finalize, the process aborts
    ("terminate called without an active exception", SIGABRT after a run
    that trained: twice on a loaded 2-core machine); if it gets there while
    the main thread holds the GIL inside Gloo's destructor, which joins the
    worker threads, both wait for good. Sleeping hands the thread the GIL.
    """
    if dist.get_backend() != "gloo":
        return
    # What the collective filled: the tensor, or the base of a view of it
    # (full_tensor's), which Python holds once and each view once more.
    filled, views = {}, {}
    for t in tensors:
        base = t._base if t._is_view() else t
        filled[id(base)] = base
        views[id(base)] = views.get(id(base), 0) + (base is not t)
    deadline = time.monotonic() + seconds
    while any(base._use_count() > 1 + views[key] for key, base in filled.items()) and time.monotonic() < deadline:
        time.sleep(1e-4)
