"""N-Grammys' key observation on our model: how often the target's next token is among the
top-k of the model-derived bigram (and unigram), for k = 1, 5, 10, 25, over the target's own
greedy HumanEval outputs (both prompt forms). Writes a plot and JSON under results/.

    python benchmarks/bigram_coverage.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vllm_retrieval_spec.compat import configure_vllm_environment

configure_vllm_environment(in_process=True)

from vllm_retrieval_spec.evaluation.replay import GreedyTrace  # noqa: E402
from vllm_retrieval_spec.evaluation.traces import greedy_traces  # noqa: E402
from vllm_retrieval_spec.models import ensure_smollm2_checkpoint  # noqa: E402
from vllm_retrieval_spec.ngrams.table import ModelIdentity, NgramTable, default_table_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KS = (1, 5, 10, 25)


def coverage(table: NgramTable, traces: list[GreedyTrace]) -> dict[str, list[float] | int]:
    """Top-k hit rates of the bigram (and unigram) on the next token of every output position."""
    previous, target = [], []
    for trace in traces:
        full = trace.prompt_ids + trace.output_ids
        start = len(trace.prompt_ids)
        previous += full[start - 1:-1]
        target += full[start:]
    previous, target = np.array(previous), np.array(target)
    ranks = table.bigram_tokens[previous]  # [n, k]
    hits = ranks == target[:, None]
    result = {"bigram": [float(hits[:, :k].any(axis=1).mean()) for k in KS if k <= table.max_drafts]}
    if table.unigram_ranking is not None:
        position = np.empty_like(table.unigram_ranking)
        position[table.unigram_ranking] = np.arange(len(position))
        result["unigram"] = [float((position[target] < k).mean()) for k in KS]
    result["positions"] = len(target)
    return result


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = ensure_smollm2_checkpoint()
    table = NgramTable.open(default_table_dir(ModelIdentity.of(model)), expected_model=ModelIdentity.of(model))
    report = {"ks": list(KS), "table_k": table.max_drafts}
    figure, axis = plt.subplots(figsize=(6, 4))
    for form in ("raw", "chat"):
        report[form] = coverage(table, greedy_traces(model, form, 164, 128))
        for source in ("bigram", "unigram"):
            if source in report[form]:
                values = report[form][source]
                axis.plot(KS[: len(values)], values, marker="o", label=f"{source}, {form} prompts")
        print(f"{form}: " + ", ".join(
            f"{s} top-{k} {v:.1%}" for s in ("bigram", "unigram") for k, v in zip(KS, report[form].get(s, []))))
    axis.set_xlabel("k (top-k of the model-derived n-gram)")
    axis.set_ylabel("target's next token in the top-k")
    axis.set_title("SmolLM2-135M-Instruct on its HumanEval outputs")
    axis.set_xticks(KS)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    figure.savefig(RESULTS / "bigram_topk_coverage.png", dpi=120)
    (RESULTS / "bigram_topk_coverage.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"written: {RESULTS / 'bigram_topk_coverage.png'}")


if __name__ == "__main__":
    main()
