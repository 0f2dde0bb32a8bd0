"""The one typed config tree of a run: model / data / training / run.

Every field is documented where it is declared (the `help` text is also what `--help` prints).
The tree is filled from a YAML recipe (`--config recipe.yaml`, nested by section or flat) and from
command-line flags, the flags winning; it is written back, resolved, to `output_dir/config.yaml`,
which is itself a valid recipe. Flag names and meanings follow transformers'
`run_mlm_no_trainer.py`. This package never reads launcher environment variables.

This is its public surface: the sections (`sections.py`: model and data; `training.py`; `run.py`),
the tree and how flags and recipes fill it (`tree.py`).

May import: `mlm_ddp.errors` and itself; every other folder reads the config, so it reads none of them.
"""

from mlm_ddp.config.run import RunConfig
from mlm_ddp.config.sections import DataConfig, ModelConfig, _doc
from mlm_ddp.config.training import TrainingConfig
from mlm_ddp.config.tree import Config, from_dict, load_recipe, parse_args, parse_exactly

__all__ = ["Config", "DataConfig", "ModelConfig", "RunConfig", "TrainingConfig", "_doc", "from_dict", "load_recipe",
           "parse_args", "parse_exactly"]
