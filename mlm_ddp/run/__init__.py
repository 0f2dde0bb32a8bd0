"""What a run leaves in its folder and says: the folder and resume policy (`run_folder`; whether its run
finished: `finished`), metrics.jsonl and the trackers (`run_log`), the HTML report (behind
`python -m mlm_ddp.report`), the Hub, the sentence-transformers files, the probe inside training (`probing`).

May import: everything below it (config, cluster/, model/, data/, loop/, probe/). Nothing imports
run/ but the entry points.
"""
