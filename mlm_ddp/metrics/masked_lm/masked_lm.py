"""Masked-LM evaluation metric, a local `evaluate` module (no Hub download).

Inputs are per-batch SUMS, not means: the summed cross-entropy over masked tokens, the number of
masked tokens and the number predicted correctly. The metric divides the totals, which gives the
per-token loss however the tokens were spread over batches and ranks (a mean of batch means does not).
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Per-token masked-LM loss, perplexity and accuracy from summed batch statistics."
_KWARGS_DESCRIPTION = """
Args:
    loss_sum: summed cross-entropy (nats) over the masked tokens of each batch.
    num_tokens: number of masked tokens of each batch.
    num_correct: number of masked tokens whose argmax prediction is the original token.
Returns:
    loss: total loss_sum / total num_tokens; perplexity: exp(loss); accuracy; num_tokens.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MaskedLM(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "loss_sum": datasets.Value("float64"),
                    "num_tokens": datasets.Value("int64"),
                    "num_correct": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, loss_sum, num_tokens, num_correct):
        tokens = int(sum(num_tokens))
        if tokens == 0:
            raise ValueError("masked_lm metric: no masked tokens were evaluated")
        loss = float(sum(loss_sum)) / tokens
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),  # exp overflows float64 past ~709
            "accuracy": int(sum(num_correct)) / tokens,
            "num_tokens": tokens,
        }
