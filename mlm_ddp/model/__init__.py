"""The network and its objective: model and tokenizer loading, the masked-LM loss as sums, FSDP units
(`loading`), --config_overrides checked on the model they make (`overrides`), whether a model folder holds
its tokenizer (`tokenizer_files`), the last layer on masked positions and the cheap dropout draws
(`fast_paths`), the masked positions' layout (`positions`), a vocabulary grown by the domain's words and
the embedding rows of its new tokens (`vocabulary`).

May import: `config`, `errors` and itself. Not data/ (the model knows no data), loop/, run/.
"""
