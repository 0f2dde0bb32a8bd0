"""The downstream probe: `python -m mlm_ddp.probe` (`standalone`, run through `__main__`), its features
and short fine-tune (`features`), like-with-like and the paired change (`compare`), and the settings both of
those read (`config`: `ProbeConfig`), so that neither imports the other.

May import: `config`, `errors`, data/, model/, loop/ (a trained model's loading). Not run/:
the probe inside a training run is run/probing.py.
"""
