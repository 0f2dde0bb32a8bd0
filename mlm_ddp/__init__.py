"""mlm_ddp: masked-language-model fine-tuning of BERT-family models, from one CPU to a Slurm cluster."""

import os

__version__ = "0.1.0"
# The process that started this one, read first (before torch is imported, seconds later): a torchrun worker
# whose agent died before the worker asked Linux to end it with the agent (cluster/generation.die_with_agent)
# has another parent by then.
STARTED_BY = os.getppid()
