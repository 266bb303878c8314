"""Evaluation: evaluate.py (teacher-forced loss, decoding, scores, outputs: a library function),
metrics.py (BLEU, chrF, ROUGE, accuracy, perplexity, Lead-3), plots.py (PNG figures) and
predict.py (batch inference over a file of inputs), resume.py (what its --resume keeps).
Nothing here imports the training package."""
