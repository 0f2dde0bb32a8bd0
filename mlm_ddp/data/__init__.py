"""Text -> tokens -> packed blocks -> per-rank batches. Knows nothing about the model.

One module per step of the pipeline:

- `text`: load the raw texts (local files, `datasets` names, the embedded corpus), or `prepared`:
  memory-map a corpus that `python -m mlm_ddp.prepare` tokenized and packed once; `mixture`: several
  sources, each loaded so, mixed block by block by their weights (`mixed_stream`: streams so mixed);
- `pack`: tokenize them and pack them into blocks;
- `epochs` (map-style data) and `stream` (streams): share the blocks out over the ranks;
- `feed`: hand each optimizer step its window of micro-batches, all ranks ending each epoch together;
- `rank`: all of it assembled for one rank (`rank_data`).

Sharding, one way per kind of data, never twice (the loaders are not passed through
`accelerator.prepare`, so Accelerate does not split them again; accelerate #3547): map-style data
by `epochs`' sampler, streams by `stream`'s split of the raw texts. `masking` is the collators' BERT
masking, seeded per block.

May import: `config`, `errors`, cluster/'s collectives (the patient waits of preprocessing), model/'s
`positions` (the layout of masked positions the collator hands the model). Never loop/, run/, probe/,
nor cluster/'s heartbeat or watchdog: a feed's collectives are named through the callable it is given.
"""

# in pipeline order: load, pack, shard, feed, one rank's assembly
# isort: off
from mlm_ddp.data.text import AnyDataset, check_files, data_notes, embedded_corpus, load_text
from mlm_ddp.data.prepared import load_prepared
from mlm_ddp.data.pack import tokenize_and_pack
from mlm_ddp.data.mixture import load_data, source_changes, sources_read_line, uncounted_note
from mlm_ddp.data.stream import check_stream_resume, shard_sizes, stale_stream_position
from mlm_ddp.data.feed import FeedPosition, TrainFeed
from mlm_ddp.data.rank import RankData, rank_data, to_device
# isort: on

# What the rest of mlm_ddp uses (train, bench, evaluation, tokenizer), in pipeline order; everything
# else, tests included, imports from the module that owns the name.
__all__ = [
    "AnyDataset",
    "check_files",
    "data_notes",
    "embedded_corpus",
    "load_text",
    "load_prepared",
    "load_data",
    "source_changes",
    "sources_read_line",
    "uncounted_note",
    "tokenize_and_pack",
    "check_stream_resume",
    "shard_sizes",
    "stale_stream_position",
    "FeedPosition",
    "TrainFeed",
    "RankData",
    "rank_data",
    "to_device",
]
