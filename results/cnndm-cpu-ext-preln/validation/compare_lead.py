"""This run's validation summaries against Lead under the same rule (the first sentences until 60 words,
at most 4): ROUGE on the first 1,000 articles (where best.pt was picked), on the other 3,368 and on all,
and a paired bootstrap of the per-article difference. From the repository root:

    python results/cnndm-cpu-ext-preln/validation/compare_lead.py PREDICTIONS.validation.jsonl
"""

import json
import sys

import numpy as np

from scratchformer import data as D
from scratchformer.data.sentences import split_sentences
from scratchformer.evaluation import metrics as M

KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def main(path: str) -> None:
    preds = [json.loads(line) for line in open(path)]
    source = D.resolve_source("cnn_dailymail", data="../shared/data/cnn_dailymail", task="extractive")
    examples = D.load_split(source, "validation")
    if len(examples) != len(preds):
        raise SystemExit(f"{path}: {len(preds)} predictions for {len(examples)} articles")
    docs, refs = [e.src for e in examples], [e.tgt for e in examples]
    hyp = [p["prediction"] for p in preds]
    lead = [M.lead3(d, 4, 60) for d in docs]
    same = sum(h.split("\n") == s.split("\n") for h, s in zip(hyp, lead))
    first = sum(h.split("\n")[0] == split_sentences(d)[0] for h, d in zip(hyp, docs))
    print(f"model summary == Lead's under the rule: {same} of {len(hyp)}; starts with the first sentence: {first}")
    for name, part in (("first 1000", slice(0, 1000)), ("other 3368", slice(1000, None)), ("all", slice(None))):
        m, s = (" / ".join(f"{r[k]:.2f}" for k in KEYS) for r in (M.rouge(hyp[part], refs[part]),
                                                                    M.rouge(lead[part], refs[part])))
        print(f"{name}: model {m} | Lead {s}")
    scorer = M._rouge_scorer_module().RougeScorer(["rouge1", "rougeLsum"], use_stemmer=True)
    diffs = {"rouge1": [], "rougeLsum": []}
    for h, s, r in zip(hyp, lead, refs):
        a = scorer.score(M._one_per_line(r), M._one_per_line(h))
        b = scorer.score(M._one_per_line(r), M._one_per_line(s))
        for k in diffs:
            diffs[k].append(100 * (a[k].fmeasure - b[k].fmeasure))
    rng = np.random.default_rng(0)
    for k, d in diffs.items():
        d = np.array(d)
        boot = [d[rng.integers(0, len(d), len(d))].mean() for _ in range(2000)]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(f"{k} model - Lead: {d.mean():+.3f} (paired bootstrap 95% [{lo:+.3f}, {hi:+.3f}]), "
              f"differs on {np.count_nonzero(d)} articles")


if __name__ == "__main__":
    main(sys.argv[1])
