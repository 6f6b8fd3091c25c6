"""The layers of hpctrain, bottom up: the one table that docs/architecture.md ("Layers") describes and
tests/unit/test_layers.py enforces.

A module may import modules of its own layer and of the layers below it, never above, function-level
imports included; modules of one layer must not import each other in a cycle. A module belongs to the
unit (a package or a module) with the longest name that is it or holds it; the root ``hpctrain`` unit
is ``hpctrain/__init__.py`` alone.

data, plan, sweep and monitor sit as low as their imports allow (data needs only runtime; plan only
config; sweep only plan and below; monitor only config and below). The commands (``hpctrain/commands/``, one module per subcommand) and the
entry point (``hpctrain/cli.py``) are the top layer, so no library package sits high for its command.

No torch, no MPI: the modules of the layers in ``NO_TORCH_LAYERS`` (base, config, plan, sweep) import
neither torch nor mpi4py anywhere, and importing all of them loads neither (tests/unit/test_layers.py
checks both); every other layer needs torch.
"""
from __future__ import annotations

ROOT = "hpctrain"

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("hpctrain", "hpctrain.errors", "hpctrain.exit_codes", "hpctrain.layers")),
    ("runtime", ("hpctrain.runtime",)),
    ("data", ("hpctrain.data",)),
    ("profiling", ("hpctrain.profiling",)),
    ("config", ("hpctrain.config",)),
    ("plan", ("hpctrain.plan",)),
    ("sweep", ("hpctrain.sweep",)),
    ("monitor", ("hpctrain.monitor",)),
    ("backends", ("hpctrain.comm.backends",)),
    ("collectives", ("hpctrain.comm",)),
    ("grid", ("hpctrain.comm.grid",)),
    ("compression", ("hpctrain.compression",)),
    ("parallel", ("hpctrain.parallel",)),
    ("models", ("hpctrain.models",)),
    ("optim", ("hpctrain.optim",)),
    ("checkpoint", ("hpctrain.checkpoint",)),
    ("interop", ("hpctrain.interop",)),
    ("train", ("hpctrain.train",)),
    ("bench", ("hpctrain.bench",)),
    ("tools", ("hpctrain.tools",)),
    ("cli", ("hpctrain.commands", "hpctrain.cli")),
)

NO_TORCH_LAYERS: tuple[str, ...] = ("base", "config", "plan", "sweep")  # neither torch nor mpi4py


def unit_of(module: str) -> str:
    """The unit of LAYERS that ``module`` (a dotted name) belongs to; KeyError if none."""
    units = [unit for _, layer in LAYERS for unit in layer
             if module == unit or (unit != ROOT and module.startswith(unit + "."))]
    if not units:
        raise KeyError(f"{module} is in no layer: add it to LAYERS in hpctrain/layers.py and to the table of "
                       f"docs/architecture.md")
    return max(units, key=len)


def layer_of(module: str) -> int:
    """The position of ``module``'s layer in LAYERS (0 = the bottom)."""
    unit = unit_of(module)
    return next(i for i, (_, layer) in enumerate(LAYERS) if unit in layer)
