"""One optimizer step and what runs beside it: the step (`step`), evaluation, the optimizer and its
schedule, loss spikes, decay branches, speed and the training clock, the checkpoint protocol, and
a trained model loaded for use (`trained`).

May import: `config`, `errors`, cluster/, model/, data/. Not run/ (the run's outputs sit above).
"""
