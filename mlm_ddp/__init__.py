"""mlm_ddp: masked-language-model fine-tuning of BERT-family models, from one CPU to a Slurm cluster."""

__version__ = "0.1.0"
