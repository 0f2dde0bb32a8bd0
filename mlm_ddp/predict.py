"""`python -m mlm_ddp.predict MODEL_DIR "The capital of France is [MASK]."`: top-k fill-mask predictions.

MODEL_DIR is a run's `final/` folder, any transformers masked-LM folder, or a checkpoint folder
`checkpoints/step-N/` (its `config.yaml` names the base model and tokenizer; its weights are the
trained ones). Texts come from the command line or, without any, one per line from stdin.
`--compare BASE_MODEL` prints the base model's predictions beside them: what fine-tuning changed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import torch

from mlm_ddp import compat
from mlm_ddp.config import checks
from mlm_ddp.errors import BadInput, say
from mlm_ddp.loop.trained import load_for_prediction
from mlm_ddp.model.loading import check_local


@dataclass(frozen=True)
class Prediction:
    token: str
    score: float  # softmax probability over the vocabulary


@torch.no_grad()
def fill_mask(model: torch.nn.Module, tokenizer: Any, text: str, top_k: int) -> list[list[Prediction]]:
    """For each mask token of `text`, in order: the top_k tokens with their probabilities."""
    encoded = tokenizer(text, return_tensors="pt", truncation=True)
    positions = (encoded["input_ids"][0] == tokenizer.mask_token_id).nonzero().flatten()  # (M,)
    written = len(tokenizer(text)["input_ids"])  # untruncated: a mask past the model's length was cut off
    if positions.numel() == 0 and tokenizer.mask_token in text and written > encoded["input_ids"].shape[1]:
        raise BadInput(f"{text[:40]!r}...: its {tokenizer.mask_token} lies past the model's maximum of "
                       f"{encoded['input_ids'].shape[1]} tokens (the text has {written}); shorten the text before it")
    if positions.numel() == 0:
        raise BadInput(f"no {tokenizer.mask_token} in {text!r}: write {tokenizer.mask_token} where a word "
                          "should be predicted")
    logits = model(**encoded).logits[0, positions]  # (M, V)
    if top_k > logits.shape[-1]:
        raise BadInput(f"--top_k {top_k} is above the model's vocabulary of {logits.shape[-1]} tokens; use "
                       f"--top_k {logits.shape[-1]} or less")
    top = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    return [
        [Prediction(tokenizer.decode([i]).strip(), p) for p, i in zip(probs, ids, strict=True)]
        for probs, ids in zip(top.values.tolist(), top.indices.tolist(), strict=True)
    ]


def format_predictions(text: str, tuned: list[list[Prediction]], base: list[list[Prediction]] | None,
                       labels: tuple[str, str]) -> str:
    lines = [text]
    for m, predictions in enumerate(tuned):
        header = f"  mask {m + 1}: {labels[0]:<28}" + (f"  {labels[1]}" if base else "")
        lines.append(header.rstrip())
        for rank, pred in enumerate(predictions):
            row = f"    {rank + 1:>2}. {pred.token:<18} {pred.score:7.4f}"
            if base:
                other = base[m][rank]
                row += f"     {other.token:<18} {other.score:7.4f}"
            lines.append(row)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlm_ddp.predict", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("model", metavar="MODEL", help="final/ folder, model folder or checkpoints/step-N folder")
    p.add_argument("texts", nargs="*", help="texts with the mask token; none: one per line from stdin")
    p.add_argument("--top_k", type=int, default=5, help="predictions per mask token")
    p.add_argument("--compare", metavar="BASE_MODEL", default=None,
                   help="also show this model's predictions (e.g. the model the run started from)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)  # options before, between or after the texts
    try:
        compat.check()
        texts = args.texts or [line.strip() for line in sys.stdin if line.strip()]
        for text in texts:  # bytes that are not UTF-8 reach us as surrogates, which the tokenizer cannot take
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise BadInput(f"{text[:40]!r}: not UTF-8 text ({err.reason}); give texts in UTF-8") from err
        checks.at_least("--top_k", args.top_k, 1)
        if not texts:
            raise BadInput("no text given: pass texts as arguments or one per line on stdin")
        for name, given in ((args.model, "MODEL"), (args.compare, "--compare")):
            if name is not None:
                check_local(name, given)
        model, tokenizer = load_for_prediction(args.model)
        base = load_for_prediction(args.compare) if args.compare else None
        for i, text in enumerate(texts):
            tuned = fill_mask(model, tokenizer, text, args.top_k)
            compared = fill_mask(*base, text.replace(tokenizer.mask_token, base[1].mask_token),
                                 args.top_k) if base else None
            print(("\n" if i else "") + format_predictions(text, tuned, compared, (args.model, args.compare or "")))
    except UnicodeDecodeError as err:  # stdin read strictly as UTF-8
        say(f"mlm_ddp.predict: error: stdin is not UTF-8 text ({err.reason} at byte {err.start}); give texts in UTF-8")
        return 2
    except BadInput as err:
        say(err.line("mlm_ddp.predict"))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
