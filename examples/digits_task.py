"""What the PyTorch examples share: scikit-learn's handwritten digits and
the MLP they train on it, and starting a torch.distributed process group.

The examples import it as a sibling module: run them as scripts
(`python examples/torch_mlp.py`, `torchrun ... examples/ddp.py`).
"""

import os

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits


def digits(seed=0):
    """(x_train, y_train, x_test, y_test) as tensors: 1197 training and 600 test images."""
    data = load_digits()
    order = np.random.default_rng(seed).permutation(len(data.target))
    x, y = torch.tensor(data.data[order] / 16.0, dtype=torch.float32), torch.tensor(data.target[order])
    return x[:1197], y[:1197], x[1197:], y[1197:]


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
