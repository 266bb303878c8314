"""Evaluation: evaluate.py (teacher-forced loss, decoding, scores, outputs: a library function),
metrics.py (BLEU, chrF, ROUGE, accuracy, perplexity, Lead-3) and plots.py (PNG figures).
Nothing here imports the training package."""
