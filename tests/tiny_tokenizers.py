"""Tiny fast tokenizers of the three families a BERT-style encoder ships with, trained in-process on the
test corpus with `tokenizers` (deterministic for a given text and size): WordPiece comes from tests/data
(conftest's tiny_model), byte-level BPE as RoBERTa's, Unigram with Metaspace as SentencePiece's."""

from __future__ import annotations

from typing import Any


def byte_bpe(texts: list[str], vocab_size: int = 500) -> Any:
    """RoBERTa's kind: byte-level BPE, '<s> text </s>'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                                   sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                                   model_max_length=64)


def unigram(texts: list[str], vocab_size: int = 400) -> Any:
    """SentencePiece's kind: Unigram over Metaspace ('▁' a space), '[CLS] text [SEP]'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend.train_from_iterator(texts, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                               unk_token="[UNK]"))
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)
