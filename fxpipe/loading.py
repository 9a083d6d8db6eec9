"""Models named on the command line: a bundled one, or MODULE:FACTORY with described inputs."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from fxpipe.errors import FxpipeError
from fxpipe.models import MODELS, BundledModel, bundled

__all__ = ["bench_build", "bundled_model", "factory", "load_model"]


def load_model(spec: str, batch: int, shapes: Sequence[str] | None, dtype: str, high: int):
    """A bundled model by name, or MODULE:FACTORY with inputs described on the command line."""
    make = factory(spec)
    if make is None:
        if shapes:
            raise FxpipeError(f"--input-shape describes the input of a MODULE:FACTORY model; the "
                              f"bundled model {spec!r} makes its own inputs: drop the flag.")
        model_spec = bundled(spec)
        x, _ = model_spec.batch(batch, torch.Generator().manual_seed(0))
        return model_spec.build(), (x,)
    inputs = _inputs(batch, shapes, dtype, high)
    try:
        model = make()
    except TypeError as e:
        raise FxpipeError(f"{spec} must be callable with no arguments and return the model "
                          f"({e}); wrap it, e.g. def make_model(): return Net(width=64).") from e
    if not isinstance(model, torch.nn.Module):
        raise FxpipeError(f"{spec} returned {type(model).__name__}, not an nn.Module.")
    return model, inputs


def bundled_model(name: str) -> BundledModel:
    """The bundled model `name`, whose optional package, where it needs one, is installed."""
    spec = bundled(name)
    if spec.needs and importlib.util.find_spec(spec.needs) is None:
        raise FxpipeError(f"the bundled model {name!r} is built with {spec.needs}, which is not "
                          "installed here: pip install 'fxpipe[hf]', or choose another model "
                          f"({', '.join(n for n, m in MODELS.items() if not m.needs)}).")
    return spec


def factory(spec: str):
    """The MODULE:FACTORY callable, or None for a bundled model's name; unknown names fail."""
    if ":" not in spec:
        if spec not in MODELS:
            raise FxpipeError(f"{spec!r} is neither a bundled model ({', '.join(MODELS)}) nor "
                              "MODULE:FACTORY (e.g. mypkg.models:make_model).")
        bundled_model(spec)
        return None
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise FxpipeError(f"{spec!r} names no {'module' if not module_name else 'factory'}: "
                          "give MODULE:FACTORY, e.g. mypkg.models:make_model.")
    if module_name.startswith("."):
        raise FxpipeError(f"{spec!r} names a relative module; give its full dotted name, e.g. "
                          f"mypkg{module_name}:{factory_name}.")
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` would find it
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise FxpipeError(_import_failure(spec, module_name, e)) from e
    if not hasattr(module, factory_name):
        raise FxpipeError(f"cannot load {spec!r}: module {module_name!r} has no "
                          f"{factory_name!r}; give the name of a function defined in it.")
    factory = getattr(module, factory_name)
    if isinstance(factory, torch.nn.Module):
        raise FxpipeError(f"{spec} is a model, not a function that makes one: give a factory, "
                          f"e.g. def make_model(): return {type(factory).__name__}(...).")
    return factory


def _import_failure(spec: str, module_name: str, error: ImportError) -> str:
    """Why MODULE did not import, and what to do: the module (or a package on its way) not
    found, or an import inside it failing."""
    missing = error.name if isinstance(error, ModuleNotFoundError) else None
    if missing and (module_name.endswith(".py") or "/" in module_name or "\\" in module_name):
        dotted = module_name.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
        factory_name = spec.rpartition(":")[2]
        return (f"cannot load {spec!r}: it names a file; give the module's dotted name, e.g. "
                f"{dotted}:{factory_name}.")
    if missing and (module_name == missing or module_name.startswith(missing + ".")):
        package, _, name = missing.rpartition(".")
        if package:  # its parent was found: Python looks for a submodule only then
            return (f"cannot load {spec!r}: {package!r} has no submodule {name!r} "
                    f"({error}); check the name.")
        return (f"cannot load {spec!r}: no module {missing!r} on the Python path; run fxpipe "
                "from the directory that holds it, or add that directory to PYTHONPATH.")
    fix = "install it" if missing else "fix that import"
    return f"cannot load {spec!r}: importing {module_name!r} failed ({error}); {fix}."


def _inputs(batch: int, shapes: Sequence[str] | None, dtype: str, high: int) -> tuple:
    """Random example inputs: one per --input-shape, with the batch in front."""
    if not shapes:
        raise FxpipeError("describe the model's input: --input-shape 3x32x32 (per sample, "
                          "without the batch; repeat the flag for several inputs).")
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise FxpipeError(f"--input-dtype {dtype!r} is not a torch dtype; use e.g. float32 "
                          "or int64.")
    inputs = []
    for shape in shapes:
        try:
            dims = [batch, *(int(d) for d in shape.lower().split("x") if d)]
        except ValueError as e:
            raise FxpipeError(f"--input-shape {shape!r}: give sizes joined by x, such as "
                              "3x32x32.") from e
        if kind.is_floating_point:
            inputs.append(torch.randn(dims, dtype=kind))
        else:
            inputs.append(torch.randint(0, high, dims, dtype=kind))
    return tuple(inputs)


def _target_and_loss(name: str, batch: int):
    """The target of load_model's inputs (the same seeded draw) and the loss to train with."""
    if ":" not in name:
        spec = bundled(name)
        _, target = spec.batch(batch, torch.Generator().manual_seed(0))
        return target, spec.loss_fn
    # a model of the user's: no labels, so train it to shrink its outputs (a stand-in loss;
    # the output may be a structure, such as a HuggingFace model's)
    return torch.zeros(batch), lambda output, _: sum(
        t.float().square().mean() for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point())


def bench_build(spec: str, batch: int, shapes: Sequence[str] | None, dtype: str,
                high: int) -> Callable[[], tuple]:
    """The benchmark's model factory: (model, x, y, loss_fn), fresh each call."""

    def build():
        torch.manual_seed(0)
        model, inputs = load_model(spec, batch, shapes, dtype, high)
        target, loss_fn = _target_and_loss(spec, batch)
        return model, inputs[0] if len(inputs) == 1 else inputs, target, loss_fn

    return build
