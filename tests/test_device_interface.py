"""The device interface (collectives/devices/__init__.py: Device, and the
optional PreparedLaunches) lists every method and attribute the executors
use on a device, and both implementations implement all of it: what the
executors call is read from their source (every use of a name that holds
a device: `device`, `self.device`, `devices[k]`, a loop over devices)."""

import ast
from pathlib import Path

import pytest

from collectives.devices import Device, PreparedLaunches

PACKAGE = Path(__file__).resolve().parents[1] / "collectives"
# The code that runs on devices: the executors, and the modules above them that reach a device.
USERS = sorted((PACKAGE / "executors").glob("*.py")) + [
    PACKAGE / name for name in ("graph.py", "fusion.py", "communicator.py", "compression/wire.py")]
DEVICE_NAMES = {"device", "devices", "rank_devices", "_device", "_devices"}


def interface(cls):
    return {name for name in {*vars(cls), *getattr(cls, "__annotations__", {})} if not name.startswith("_")}


def _names_devices(node):
    """Whether `node` names a collection of devices (`devices`, `self.rank_devices`)."""
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in DEVICE_NAMES and name.endswith("devices")


class DeviceUses(ast.NodeVisitor):
    """The attributes read on device objects in a module, by name."""

    def __init__(self):
        self.used = {}           # attribute -> lines
        self._bound = [set()]    # per function: the names that hold a device

    def _is_device(self, node):
        if isinstance(node, ast.Name):
            return node.id == "device" or node.id in self._bound[-1]
        if isinstance(node, ast.Attribute):   # self.device, self._device
            return isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in ("device", "_device")
        if isinstance(node, ast.Subscript):   # devices[k], self.devices[0]
            return _names_devices(node.value)
        return False

    def _bind(self, target, iterable):
        """Names a loop over devices binds to a device: `for d in devices`,
        `for d, s in zip(devices, streams)`."""
        if isinstance(target, ast.Name) and _names_devices(iterable):
            self._bound[-1].add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(iterable, ast.Call) and \
                getattr(iterable.func, "id", None) == "zip":
            for element, source in zip(target.elts, iterable.args):
                self._bind(element, source)

    def visit_FunctionDef(self, node):
        self._bound.append(set(self._bound[-1]))
        self.generic_visit(node)
        self._bound.pop()

    visit_Lambda = visit_FunctionDef

    def visit_For(self, node):
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node):
        self._bind(node.target, node.iter)
        self.generic_visit(node)

    def visit_ListComp(self, node):   # generators first: they bind the names the element uses
        for generator in node.generators:
            self.visit(generator)
        self.visit(node.elt)

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_Attribute(self, node):
        if self._is_device(node.value):
            self.used.setdefault(node.attr, []).append(node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node):   # getattr(device, "step_launcher", None): an optional method
        if getattr(node.func, "id", None) in ("getattr", "hasattr") and len(node.args) >= 2 and \
                self._is_device(node.args[0]) and isinstance(node.args[1], ast.Constant):
            self.used.setdefault(node.args[1].value, []).append(node.lineno)
        self.generic_visit(node)


def device_uses(source):
    uses = DeviceUses()
    uses.visit(ast.parse(source))
    return uses.used


def test_the_scan_finds_a_use_outside_the_interface():
    # The scan itself: a method the interface lacks, reached by each way of naming a device, is found.
    source = """
def f(self, devices, streams):
    device.alpha()
    self.device.beta
    devices[0].gamma()
    for d in self.devices:
        d.delta()
    for d, s in zip(devices, streams):
        d.epsilon(s)
    [x.zeta for x in self.rank_devices]
    getattr(device, "eta", None)
"""
    assert set(device_uses(source)) == {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"}


@pytest.mark.parametrize("path", USERS, ids=lambda path: path.name)
def test_the_executors_use_only_what_the_interface_lists(path):
    listed = interface(Device) | interface(PreparedLaunches)
    unlisted = {name: lines for name, lines in device_uses(path.read_text()).items() if name not in listed}
    assert not unlisted, f"{path.name} uses on a device what collectives/devices/__init__.py does not list: {unlisted}"


def test_everything_the_interface_lists_is_used():
    used = set()
    for path in USERS:
        used |= set(device_uses(path.read_text()))
    listed = interface(Device) | interface(PreparedLaunches)
    assert listed - used - {"use"} == set(), \
        "listed, yet no executor uses it: remove it from the interface (`use`: collectives.init calls it)"


@pytest.mark.parametrize("module, name", [("emulated", "EmulatedDevice"), ("cuda", "CudaDevice")])
def test_both_devices_implement_the_whole_interface(module, name):
    import importlib
    cls = getattr(importlib.import_module(f"collectives.devices.{module}"), name)
    assert issubclass(cls, Device)
    methods = {n for n in interface(Device) if callable(getattr(Device, n, None))}
    assert not {n for n in methods if getattr(cls, n) is getattr(Device, n)}, "methods left to the interface"
    if issubclass(cls, PreparedLaunches):   # the CUDA adapter's prepared launches: all of them
        assert not {n for n in interface(PreparedLaunches) if getattr(cls, n) is getattr(PreparedLaunches, n)}
