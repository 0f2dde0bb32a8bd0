"""Processes and the process group: launcher detection (`launcher`, behind `python -m mlm_ddp.distributed`),
the Accelerator and its collectives, the job's precision, the Flight Recorder, heartbeats and the
hang watchdog, durable (fsynced, atomic) writes.

May import: `mlm_ddp.errors` and itself. Nothing here knows about the model, the data or a run.
"""
