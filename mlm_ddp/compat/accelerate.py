"""accelerate's names that are not its public API, which mlm_ddp reaches (see mlm_ddp/compat/__init__.py).

Each function here is the only place in mlm_ddp that touches its name; each `present` looks the name up
when it is called. accelerate is imported inside the functions, as mlm_ddp does everywhere below loop/.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from typing import Any

from mlm_ddp.compat import Reach

LAUNCH = "accelerate.commands.launch"
CONFIG = "accelerate.commands.config"


# --- FSDP on CPU processes ----------------------------------------------------------------------------------------

def train_fsdp(accelerator: Any, plugin: Any) -> None:
    """Make `accelerator`'s state the one AcceleratorState sets up for FSDP on a GPU: its plugin and its
    distributed type, in both states (every later AcceleratorState() copies PartialState's). accelerate
    has no public way to ask for FSDP where it would choose DDP (MULTI_CPU)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP


def _state_source() -> str:
    from accelerate.state import AcceleratorState

    return inspect.getsource(AcceleratorState.__init__)


def _fsdp_is_these_attributes() -> bool:
    """AcceleratorState turns FSDP on by setting its distributed type and its plugin, nothing else."""
    source = _state_source()
    return "self.distributed_type = DistributedType.FSDP" in source and "self.fsdp_plugin = fsdp_plugin" in source


def _state_copies_partial_state() -> bool:
    from accelerate.state import PartialState

    return ("self.__dict__.update(PartialState._shared_state)" in _state_source()
            and "_shared_state" in vars(PartialState))


# --- the micro-batch counter --------------------------------------------------------------------------------------

def set_micro_batch_count(accelerator: Any, count: int) -> None:
    """The count of micro-batches `accumulate` has seen, which decides the one whose backward all-reduces
    the gradients (every gradient_accumulation_steps-th). `load_state` restores the saved run's; accelerate
    has no public setter."""
    accelerator.step = count


def _sync_counts_step() -> bool:
    """accelerate decides the syncing micro-batch from `Accelerator.step`, counted up once per micro-batch."""
    from accelerate import Accelerator

    source = inspect.getsource(Accelerator._do_sync)
    return "self.step += 1" in source and "self.step % self.gradient_state.num_steps" in source


# --- what `accelerate launch` was told ----------------------------------------------------------------------------

def launch_arguments(argv: list[str]) -> argparse.Namespace | None:
    """`accelerate launch`'s own reading of its arguments `argv` (those after `launch`; the training script's
    flags after its script or -m module are left alone), or None where its parser refuses them."""
    try:
        arguments, _ = importlib.import_module(LAUNCH).launch_command_parser().parse_known_args(argv)
    except SystemExit:
        return None
    return arguments


def _launch_parser_reads_precision() -> bool:
    arguments, _ = importlib.import_module(LAUNCH).launch_command_parser().parse_known_args(
        ["--mixed_precision", "no", "train.py", "--mixed_precision", "bf16"])
    return arguments.mixed_precision == "no" and arguments.config_file is None


def default_config_file() -> str:
    """The config file `accelerate launch` reads when it is given no --config_file (`accelerate config`'s)."""
    return str(importlib.import_module(CONFIG).default_config_file)


REACHES: list[Reach] = [
    Reach("accelerate", "accelerate.state.AcceleratorState.distributed_type", _fsdp_is_these_attributes,
          "FSDP2 on CPU processes (gloo), which accelerate would run as DDP"),
    Reach("accelerate", "accelerate.state.PartialState.distributed_type", _state_copies_partial_state,
          "FSDP2 on CPU processes (gloo), which accelerate would run as DDP"),
    Reach("accelerate", "accelerate.Accelerator.step", _sync_counts_step,
          "a resumed run counts micro-batches for its own --gradient_accumulation_steps"),
    Reach("accelerate", f"{LAUNCH}.launch_command_parser", _launch_parser_reads_precision,
          "whether accelerate launch was told --mixed_precision no"),
    Reach("accelerate", f"{CONFIG}.default_config_file", lambda: hasattr(importlib.import_module(CONFIG),
                                                                         "default_config_file"),
          "whether accelerate launch's default config file says mixed_precision: no"),
]
