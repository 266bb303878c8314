"""The extractive summarizer (`--task extractive`): its data (marked sentences, oracle labels),
batches, model, loss, sentence picking, and a run from training to test predictions."""

import itertools
import json
import os
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from scratchformer import cli, evaluate, generate, train
from scratchformer import data as D
from scratchformer.data import extractive as E
from scratchformer.data.extractive import encode_documents, mark_sentences, oracle, pick_sentences, sentence_slots
from scratchformer.evaluation import predict as P
from scratchformer.evaluation.evaluate import eval_loader, predict_extracts, teacher_forced
from scratchformer.evaluation.loading import load_run
from scratchformer.evaluation.options import OptionError
from scratchformer.model import BOS_ID, ModelConfig, build_model
from scratchformer.training.ablation import _final_metric
from scratchformer.training.config import ConfigError, TrainConfig
from scratchformer.training.launch import _check_encoder_only_options, check_for_task
from scratchformer.training.optim import extractive_loss
from tests.conftest import BACKENDS, DEVICE, extractive_folder, random_sentences, report_diff


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared 2-core machine
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Oracle, marking, picking
# ---------------------------------------------------------------------------------------------


def _score(chosen, sentences, summary) -> float:
    """BertSum's objective written out: ROUGE-1 F1 + ROUGE-2 F1 over sets of lower-cased words."""
    ref = re.findall(r"[a-z0-9]+", summary.lower())
    cand = [w for i in sorted(chosen) for w in re.findall(r"[a-z0-9]+", sentences[i].lower())]
    total = 0.0
    for n in (1, 2):
        # n-grams of each sentence, not across their boundaries
        c = {g for i in chosen for g in zip(*[re.findall(r"[a-z0-9]+", sentences[i].lower())[k:] for k in range(n)])}
        r = set(zip(*[ref[k:] for k in range(n)]))
        hit = len(c & r)
        total += 0.0 if not hit else 2 * hit / (len(c) + len(r))
    return total if cand else 0.0


def test_oracle_is_the_greedy_maximum_of_rouge1_plus_rouge2():
    rng = random.Random(0)
    for _ in range(40):
        sents = random_sentences(rng, rng.randint(1, 8))
        summary = " ".join(rng.sample(sents, min(len(sents), rng.randint(1, 3)))).replace("w1 ", "w39 ")
        got = oracle(sents, summary)
        chosen: list[int] = []  # the greedy path with the objective written out: add the best while it gains
        while len(chosen) < min(3, len(sents)):
            gains = {j: _score(chosen + [j], sents, summary) for j in range(len(sents)) if j not in chosen}
            pick = max(gains, key=gains.get)
            if gains[pick] <= (_score(chosen, sents, summary) if chosen else 0.0):
                break
            chosen.append(pick)
        assert got == sorted(chosen)
        assert got == sorted(got) and len(got) <= 3


def test_oracle_finds_the_summary_sentences():
    sents = ["the cat sat on the mat .", "stocks fell in tokyo .", "rain is due on friday .", "the dog barked ."]
    assert oracle(sents, "Stocks fell in Tokyo. Rain is due on Friday.") == [1, 2]
    assert oracle(sents, "no word shared") == []
    assert oracle(sents, "") == []


def test_marking_keeps_sentences_in_order_within_the_budget():
    ids = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    assert mark_sentences(ids, 100) == ([BOS_ID, 5, 6, 7, BOS_ID, 8, 9, BOS_ID, 10, 11, 12, 13], 3)
    assert mark_sentences(ids, 9) == ([BOS_ID, 5, 6, 7, BOS_ID, 8, 9, BOS_ID, 10], 3)  # the last one cut
    assert mark_sentences(ids, 8) == ([BOS_ID, 5, 6, 7, BOS_ID, 8, 9], 2)  # no room for a third with a token


def test_encoded_documents_decode_back_to_their_sentences():
    rng = random.Random(1)
    docs = [" ".join(random_sentences(rng, rng.randint(1, 9))) for _ in range(30)]
    tok = D.BPETokenizer.train(docs, 300, min_frequency=1)
    examples = [D.Example(d, d.split(" . ")[0] + " .", str(i)) for i, d in enumerate(docs)]
    ds, stats = D.encode_examples(examples, "extractive", tok, None, max_src_len=40)
    cut = 0
    for e, src, labels, kept in zip(examples, ds.src, ds.tgt, ds.sentences, strict=True):
        assert len(src) <= 40 and src[0] == BOS_ID and (src == BOS_ID).sum() == len(labels) == len(kept)
        pieces = [list(g) for is_mark, g in itertools.groupby(src.tolist(), lambda t: t == BOS_ID) if not is_mark]
        sents = D.split_sentences(e.src)
        assert [tok.decode(p).strip() for p in pieces[:-1]] == sents[: len(pieces) - 1] == kept[:-1]
        assert sents[len(pieces) - 1].startswith(tok.decode(pieces[-1]).strip())
        cut += len(kept) < len(sents) or tok.decode(pieces[-1]).strip() != sents[len(pieces) - 1]
        assert labels.tolist() == [int(i in oracle(kept, e.tgt)) for i in range(len(kept))]
        assert labels[0] == 1  # the summary is the first sentence
    assert stats.src_truncated == cut > 0


def test_a_pool_of_processes_encodes_as_one_does():
    rng = random.Random(3)
    docs = [" ".join(random_sentences(rng, rng.randint(1, 12))) for _ in range(50)]
    summaries = [" ".join(random_sentences(rng, 2)) for _ in docs]
    tok = D.BPETokenizer.train(docs, 300, min_frequency=1)
    one = encode_documents(docs, summaries, tok, 30, processes=1)
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    two = encode_documents(docs, summaries, tok, 30, processes=2)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before  # set only while the workers fork
    assert np.array_equal(one[0].flat, two[0].flat) and np.array_equal(one[1].flat, two[1].flat)
    assert one[2:] == two[2:] and one[1].flat.sum() > 0
    # fewer documents than 8 a worker (a chunk of 5 // 16 = 0 handed out no work and read back no sentences)
    few = encode_documents(docs[:5], summaries[:5], tok, 30, processes=2)
    alone = encode_documents(docs[:5], summaries[:5], tok, 30, processes=1)
    assert np.array_equal(few[0].flat, alone[0].flat) and np.array_equal(few[1].flat, alone[1].flat)
    assert few[2:] == alone[2:]


def test_the_pool_forks_once_cuda_is_initialised_too(monkeypatch):
    """A GPU run has initialised CUDA before it builds its data (its precision, its device's description):
    the pool is made then too (it fell back to one process, CNN/DM's articles ~100 s of a GPU window)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with E._pool(2) as pool:
        assert pool is not None and pool.starmap(len, [("ab",), ("c",)]) == [2, 1]


@pytest.mark.parametrize("cores, ranks, workers", [(64, None, 16), (64, "8", 8), (12, "2", 6), (12, "1", 12),
                                                   (4, "8", 1), (1, None, 1)])
def test_the_pool_takes_this_ranks_share_of_the_cores_at_most_16(monkeypatch, cores, ranks, workers):
    """encode_documents' default pool: the cores this process may run on, divided among the LOCAL_WORLD_SIZE ranks
    of its machine (each rank encodes its own copy), at least 1 and at most 16 (64 cores alone: 16; 64 among 8
    ranks: 8; 4 among 8: 1)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert E._cores() == workers


def test_a_literal_marker_in_the_text_starts_no_sentence():
    docs = ["a tag <s> here . and more text .", "plain one ."]
    tok = D.BPETokenizer.train(docs * 5, 300, min_frequency=1)
    assert BOS_ID not in tok.encode_batch(["<s>"])[0]  # the tokenizer reads it as text
    ds, _ = D.encode_examples([D.Example(d, "more text .") for d in docs], "extractive", tok, None, 64)
    assert [int((s == BOS_ID).sum()) for s in ds.src] == [2, 1] and ds.tgt[0].tolist() == [0, 1]
    batch = D.collate([ds[0], ds[1]], task="extractive")
    assert batch.labels.tolist() == [[0, 1], [0, -1]]
    assert batch.sentences[0].tolist() == np.flatnonzero(ds.src[0] == BOS_ID).tolist()
    with pytest.raises(D.DataError, match="document 2 has no sentence"):
        D.encode_examples([D.Example("x .", "x"), D.Example("  \n ", "x")], "extractive", tok, None, 64)


def test_picking_takes_the_best_in_document_order_and_blocks_repeated_trigrams():
    sents = ["a b c d .", "x y z .", "a b c e .", "p q r .", "s t ."]
    assert pick_sentences(sents, [0.9, 0.1, 0.8, 0.7, 0.2], k=3, block_trigrams=False) == [0, 2, 3]
    assert pick_sentences(sents, [0.9, 0.1, 0.8, 0.7, 0.2], k=3) == [0, 3, 4]  # 'a b c' again: skipped
    assert pick_sentences(sents[:2], [0.0, 1.0], k=3) == [0, 1]
    # a word budget: best first until the picked hold W words (a blocked sentence counts nothing), at most k
    words = [len(x.split()) for x in sents]
    scores = [0.9, 0.1, 0.8, 0.7, 0.2]
    for budget in range(1, sum(words) + 2):
        got = pick_sentences(sents, scores, k=5, words=budget)
        unbudgeted = [i for i in (0, 3, 4, 1) if i in pick_sentences(sents, scores, k=5)]  # best first, blocked out
        want, n = [], 0
        for i in unbudgeted:
            if n >= budget:
                break
            want.append(i)
            n += words[i]
        assert got == sorted(want), budget
    assert pick_sentences(sents, scores, k=1, words=1000) == [0]
    with pytest.raises(ValueError, match="2 scores for 3 sentences"):
        pick_sentences(sents[:3], [0.0, 1.0])


def test_trigram_blocking_compares_lower_cased_word_trigrams_only():
    """A sentence is blocked when it shares a word trigram with one picked, whatever the case ("The cat
    sat" is "the cat sat"); sharing a bigram ("the cat") or a trigram across a sentence boundary blocks nothing."""
    sents = ["The cat sat down .", "the cat sat up .", "the cat ran .", "down the cat ."]
    assert pick_sentences(sents, [0.9, 0.8, 0.7, 0.6], k=4) == [0, 2, 3]
    assert pick_sentences(sents, [0.9, 0.8, 0.7, 0.6], k=4, block_trigrams=False) == [0, 1, 2, 3]
    # against every sentence picked so far, not only the last
    assert pick_sentences(["a b c .", "x y z .", "again a b c ."], [0.9, 0.8, 0.7]) == [0, 1]


def test_batches_point_at_the_markers_and_pad_the_labels():
    src = torch.tensor([[BOS_ID, 5, 6, BOS_ID, 7, BOS_ID, 8], [BOS_ID, 9, 9, 9, 0, 0, 0]])
    labels = [np.array([0, 1, 1], dtype=np.int32), np.array([1], dtype=np.int32)]
    starts, target = sentence_slots(src.numpy(), labels, pad_multiple=4)
    assert starts.tolist() == [[0, 3, 5, 0], [0, 0, 0, 0]]
    assert target.tolist() == [[0, 1, 1, -1], [1, -1, -1, -1]]
    with pytest.raises(ValueError, match="markers and labels disagree"):
        sentence_slots(src.numpy(), labels[::-1])
    items = [(0, src[0].numpy(), labels[0]), (1, src[1, :4].numpy(), labels[1])]
    batch = D.collate(items, pad_multiple=2, task="extractive")
    assert batch.shape == (2, 8, 4) and batch.num_tgt_tokens == 4
    assert batch.sentences.tolist() == [[0, 3, 5, 0], [0, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------
# Model and loss
# ---------------------------------------------------------------------------------------------


def _extractor(kernel="eager", device=DEVICE):
    cfg = ModelConfig(src_vocab_size=60, d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=0, d_ff=64,
                      dropout=0.0, extractive=True, kernel=kernel)
    return build_model(cfg, device).eval()


def _doc_items(docs):
    """docs: lists of sentence lengths -> marked random documents, as a dataset's items."""
    rng = np.random.default_rng(0)
    src = [np.concatenate([[BOS_ID, *rng.integers(4, 60, n)] for n in d]).astype(np.int32) for d in docs]
    return [(i, s, np.zeros(len(d), dtype=np.int32)) for i, (s, d) in enumerate(zip(src, docs))]


def _doc_batch(docs, device=DEVICE):
    return D.collate(_doc_items(docs), task="extractive").to(device)


def test_scores_are_the_same_alone_and_in_a_padded_batch():
    torch.manual_seed(0)
    model = _extractor()
    docs = [[3, 5, 2], [4], [6, 6, 1, 2, 3]]
    items = _doc_items(docs)
    batch = D.collate(items, task="extractive").to(DEVICE)
    with torch.no_grad():
        together = model(batch.src, batch.src_lengths, batch.sentences)
        for i, d in enumerate(docs):
            one = D.collate([items[i]], task="extractive").to(DEVICE)
            alone = model(one.src, one.src_lengths, one.sentences)[0]
            torch.testing.assert_close(together[i, : len(d)], alone, rtol=1e-5, atol=1e-5)
    assert together.shape == (3, 5)


@pytest.mark.parametrize("kernel", [k for k in BACKENDS if k != "eager"])
def test_backends_score_like_eager(kernel):
    torch.manual_seed(0)
    eager = _extractor()
    other = _extractor(kernel)
    other.load_state_dict(eager.state_dict())
    batch = _doc_batch([[3, 5, 2], [7, 1]])
    with torch.no_grad():
        ref = eager(batch.src, batch.src_lengths, batch.sentences)
        got = other(batch.src, batch.src_lengths, batch.sentences)
    assert report_diff(kernel, got, ref) < 1e-4


def test_bad_sentence_positions_are_refused():
    model = _extractor(device="cpu")  # values are checked where reading them is free (op_checks.value_checks)
    batch = _doc_batch([[3, 2]], device="cpu")
    with pytest.raises(ValueError, match=r"sentence positions must lie in \[0, 7\), got min 0 max 7"):
        model(batch.src, batch.src_lengths, torch.tensor([[0, 7]]))
    with pytest.raises(ValueError, match=r"sentences must be \(B, S\) int64 positions for 1 documents"):
        model(batch.src, batch.src_lengths, batch.sentences[0])
    for given in (None, [[0, 3]]):  # an AttributeError ('NoneType' object has no attribute 'dim')
        with pytest.raises(ValueError, match=r"sentences must be a \(B, S\) int64 tensor of positions, got "):
            model(batch.src, batch.src_lengths, given)


def test_validation_is_the_mean_bce_per_real_sentence_by_hand():
    """An extractive model's teacher-forced loss: the binary cross-entropy of each real sentence (label 0
    or 1; a padded slot's -1 is none) summed over the documents, each scored alone, over their count."""

    torch.manual_seed(0)
    model = _extractor(device="cpu")
    docs = [[3, 5, 2], [4], [6, 6, 1, 2, 3], [2, 2]]
    items = [(i, s, np.array(y, dtype=np.int32)) for (i, s, _), y in
             zip(_doc_items(docs), [[1, 0, 1], [0], [0, 1, 0, 0, 1], [1, 1]], strict=True)]
    ds = D.EncodedDataset([s for _, s, _ in items], [y for _, _, y in items], "extractive")
    total, count = 0.0, 0
    with torch.no_grad():
        for item in items:
            one = D.collate([item], task="extractive")
            logits = model(one.src, one.src_lengths, one.sentences)[0].double()
            y = torch.as_tensor(item[2], dtype=torch.float64)
            total += -float((y * F.logsigmoid(logits) + (1 - y) * F.logsigmoid(-logits)).sum())
            count += len(y)
    got = teacher_forced(model, eval_loader(ds, batch_size=2), "cpu")
    assert count == 11 and got["loss"] == pytest.approx(total / count, rel=1e-5)
    assert got["ppl"] == pytest.approx(np.exp(total / count), rel=1e-5)


def test_loss_is_bce_over_real_sentences_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 9.0], [0.3, 7.0, -7.0, -7.0]], requires_grad=True)
    labels = torch.tensor([[1, 0, 1, -1], [0, -1, -1, -1]])
    keep = labels >= 0
    loss, nll = extractive_loss(logits, labels, 0.0)
    ref = F.binary_cross_entropy_with_logits(logits[keep], labels[keep].float(), reduction="sum")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref)
    smoothed, nll2 = extractive_loss(logits, labels, 0.2)
    target = labels[keep].float() * 0.8 + 0.1
    torch.testing.assert_close(smoothed, F.binary_cross_entropy_with_logits(logits[keep], target, reduction="sum"))
    torch.testing.assert_close(nll2, ref)
    smoothed.backward()
    assert logits.grad[~keep].abs().max() == 0


def test_a_hub_dataset_of_another_task_is_not_read_as_extractive(monkeypatch):
    monkeypatch.setattr(D.datasets, "local_folder", lambda name: None)  # the hub's, not ../shared/data's copy
    assert D.resolve_source("cnn_dailymail", None, "extractive").task == "extractive"
    with pytest.raises(D.DataError, match="hub dataset 'imdb' is classification data; it cannot be read as extractive"):
        D.resolve_source("imdb", None, "extractive")


def test_options_an_extractive_run_cannot_take():
    for kw, message in [(dict(copy=True), "an extractive summarizer has no target tokens"),
                        (dict(bpe_dropout=0.1), "--task extractive encodes its marked sentences once"),
                        (dict(decoder_layers=2), "--decoder-layers 2: --task extractive trains an encoder only"),
                        (dict(best_metric="accuracy"), "extractive validation computes loss, ppl, bleu")]:
        with pytest.raises(ConfigError, match=message):
            check_for_task(TrainConfig(**kw), "extractive")
    for task in ("summarization", "translation", "classification"):  # the summary rule: extractive only
        with pytest.raises(ConfigError, match=f"--summary-words picks an extractive summarizer's sentences; {task}"):
            check_for_task(TrainConfig(summary_words=60), task)
    with pytest.raises(ConfigError, match="--summary-sentences must be an integer >= 1, got 0"):
        TrainConfig(summary_sentences=0)
    # given, a target's, a decoder's and decoding's options are refused (they were ignored); it picks the sentences
    # of --eval-decode-examples validation examples, so that one is taken
    given = frozenset({"max_tgt_len", "separate_vocab", "tie_embeddings", "beam_size", "eval_decode_examples"})
    cfg = TrainConfig(max_tgt_len=9, separate_vocab=True, tie_embeddings="decoder", beam_size=2, eval_decode_examples=5)
    with pytest.raises(ConfigError, match=r"^--max-tgt-len, --separate-vocab, --tie-embeddings, --beam-size are for a "
                                          r"target sequence, its decoder or its decoding; an extractive summarizer"):
        _check_encoder_only_options(cfg, "extractive", given)
    _check_encoder_only_options(TrainConfig(eval_decode_examples=5), "extractive", frozenset({"eval_decode_examples"}))
    with pytest.raises(ConfigError, match=r"^--tokenizer SRC TGT is for a target sequence"):
        _check_encoder_only_options(TrainConfig(tokenizer=["a.json", "b.json"]), "classification",
                                    frozenset({"tokenizer"}))


# ---------------------------------------------------------------------------------------------
# A run: train, evaluate, predict the test inputs, generate
# ---------------------------------------------------------------------------------------------


def test_a_run_learns_the_lead_and_predicts_the_test_inputs(tmp_path, capsys, caplog):
    folder = extractive_folder(tmp_path)
    out = tmp_path / "run"
    train.main(["--data", str(folder), "--task", "extractive", "--preset", "tiny", "--d-model", "32", "--heads", "2",
                "--layers", "1", "--d-ff", "64", "--vocab-size", "300", "--max-src-len", "48", "--max-steps", "60",
                "--batch-size", "24", "--lr", "3e-3", "--warmup-steps", "10", "--eval-every", "30",
                "--no-progress", "--no-plots", "--out", str(out)])
    final = json.loads((out / "metrics.final.json").read_text())
    assert set(final["scorers"]) == {"bleu", "chrf", "rouge"}  # the picks' text metrics, signed (metrics.scorers)
    preds = [json.loads(line) for line in (out / "predictions.validation.jsonl").read_text().splitlines()]
    assert len(preds) == 40 and all(p["prediction"].split("\n")[0] == p["reference"] for p in preds)
    # the lead learned: the best-scored sentence is the first (chance: 1 time in 5)
    model, toks, _ = load_run(out)
    valid = D.load_split(D.resolve_source(data=str(folder), task="extractive"), "validation")
    dataset, _ = D.encode_examples(valid, "extractive", toks.src, None, 48)
    best = predict_extracts(model, dataset, device="cpu", sentences=1)
    assert sum(b == e.tgt for b, e in zip(best, valid)) >= 36
    res = evaluate.main(["--checkpoint", str(out), "--split", "validation", "--out", str(tmp_path / "ev"),
                         "--attention", "1"])
    assert res["decoding"] == "top3" and res["rouge1"] == pytest.approx(final["top3"]["rouge1"])
    # fewer sentences: a cap, or a word budget any one sentence meets (the best alone: the lead)
    for flags, name in ((["--summary-sentences", "1"], "top1"), (["--summary-words", "1"], "top3-1w")):
        one = evaluate.main(["--checkpoint", str(out), "--split", "validation", "--out", str(tmp_path / name), *flags])
        picked = [json.loads(line)["prediction"] for line in (tmp_path / name / "predictions.validation.jsonl").open()]
        assert one["decoding"] == name and picked == [p["prediction"].split("\n")[0] for p in preds]
    assert (tmp_path / "ev" / "attention.validation.1.png").stat().st_size > 0
    with pytest.raises(cli.UsageError, match="was trained for extractive; the data is read as summarization"):
        evaluate.main(["--checkpoint", str(out), "--data", str(folder), "--task", "summarization"])
    lead = evaluate.main(["--baseline", "lead3", "--data", str(folder), "--task", "extractive"])
    assert lead["baseline"] == "lead3" and lead["n"] == 40
    lead1 = evaluate.main(["--baseline", "lead3", "--data", str(folder), "--summary-words", "1",  # the lead alone
                           "--out", str(tmp_path / "lead")])
    assert lead1["rouge1"] == pytest.approx(100.0) and lead1["words"] == 1
    assert (tmp_path / "lead" / "metrics.validation.lead-top3-1w.json").exists()  # beside Lead-3's, not over it
    summary = P.predict_file(out / "best.pt", folder / "test.jsonl", tmp_path / "test_predictions.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "test_predictions.jsonl").read_text().splitlines()]
    docs = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    assert summary["predicted"] == 12 and [r["id"] for r in rows] == [d["id"] for d in docs]
    for r, d in zip(rows, docs):
        lines = r["prediction"].split("\n")
        assert 1 <= len(lines) <= 3 and all(s in d["document"] for s in lines)
        assert lines[0] == D.split_sentences(d["document"])[0]
    # the default given explicitly is the same option: a resume keeps every prediction (was refused as a change)
    again = P.predict_file(out / "best.pt", folder / "test.jsonl", tmp_path / "test_predictions.jsonl", resume=True,
                           summary_sentences=E.MAX_ORACLE_SENTENCES)
    assert (again["kept"], again["predicted"]) == (12, 0)
    capsys.readouterr()
    got = generate.main(["--checkpoint", str(out), "--text", docs[0]["document"]])
    assert capsys.readouterr().out == rows[0]["prediction"].replace("\n", " ") + "\n"
    assert got[0]["output"] == rows[0]["prediction"]  # --json's as --output's: a sentence a line (it was one line)
    generate.main(["--checkpoint", str(out), "--text", docs[0]["document"], "--summary-sentences", "1"])
    assert capsys.readouterr().out == rows[0]["prediction"].split("\n")[0] + "\n"
    # it decodes no sequence: sequence decoding's flags are refused by name, as a classifier's are
    with pytest.raises(OptionError, match=r"^--beam-size is for decoding a sequence; this model is extractive"):
        generate.main(["--checkpoint", str(out), "--text", docs[0]["document"], "--beam-size", "2"])
    with pytest.raises(OptionError, match=r"^--max-len, --len-ratio are for decoding a sequence; this model is extr"):
        generate.main(["--checkpoint", str(out), "--input", str(folder / "test.jsonl"), "--output",
                       str(tmp_path / "refused.jsonl"), "--max-len", "5", "--len-ratio", "1"])
    with pytest.raises(OptionError, match=r"^--min-len is for decoding a sequence; this model is extractive"):
        evaluate.main(["--checkpoint", str(out), "--split", "validation", "--out", str(tmp_path / "e"), "--min-len",
                       "2"])
    with pytest.raises(OptionError, match=r"^--mbr, --sample are for decoding a sequence; this model is extractive"):
        evaluate.main(["--checkpoint", str(out), "--split", "validation", "--out", str(tmp_path / "e"), "--sample",
                       "--mbr", "2"])
    assert not (tmp_path / "refused.jsonl").exists() and not (tmp_path / "e").exists()
    P.predict_file(out, folder / "test.jsonl", tmp_path / "lead.jsonl", summary_words=1)
    assert [json.loads(line)["prediction"] for line in (tmp_path / "lead.jsonl").open()] == [
        r["prediction"].split("\n")[0] for r in rows]
    # a document over the model's 48 tokens: truncated with a warning, or refused with --strict
    long_doc = folder / "long.jsonl"
    long_doc.write_text(json.dumps({"id": "a", "document": "w1 w2 ."}) + "\n"
                        + json.dumps({"id": "b", "document": " ".join(["w3 w4 w5 w6 w7 ."] * 12)}) + "\n")
    with pytest.raises(D.DataError, match=r"long.jsonl:2: document does not fit in the model's 48 tokens"):
        P.predict_file(out, long_doc, tmp_path / "strict.jsonl", strict=True)
    P.predict_file(out, long_doc, tmp_path / "cut.jsonl")
    assert "1 of 2 documents are longer than the model's maximum of 48 tokens" in caplog.text


def test_validation_picks_best_pt_by_the_runs_summary_rule(tmp_path):
    # at most 2 sentences, stopping at 1 word: the best-scored sentence alone, which for a model that
    # learned the lead is the reference itself (ROUGE 100), where the default best 3 score far less
    folder = extractive_folder(tmp_path)
    out = tmp_path / "run"
    train.main(["--data", str(folder), "--task", "extractive", "--preset", "tiny", "--d-model", "32", "--heads", "2",
                "--layers", "1", "--d-ff", "64", "--vocab-size", "300", "--max-src-len", "48", "--max-steps", "60",
                "--batch-size", "24", "--lr", "3e-3", "--warmup-steps", "10", "--eval-every", "20",
                "--eval-decode-examples", "40", "--best-metric", "rouge1", "--summary-sentences", "2",
                "--summary-words", "1", "--no-progress", "--no-plots", "--out", str(out)])
    final = json.loads((out / "metrics.final.json").read_text())
    assert "top2-1w" in final and "top3" not in final
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = {r["step"]: r for r in rows if r.get("split") == "valid"}
    assert sorted(valid) == [20, 40, 60] and max(r["rouge1"] for r in valid.values()) > 90
    # best.pt is the step validation scored best under the rule, and scores the same again
    assert valid[final["best_step"]]["rouge1"] == max(r["rouge1"] for r in valid.values())
    assert final["top2-1w"]["rouge1"] == pytest.approx(valid[final["best_step"]]["rouge1"])
    again = evaluate.main(["--checkpoint", str(out), "--split", "validation", "--summary-sentences", "2",
                           "--summary-words", "1", "--out", str(tmp_path / "ev"), "--overwrite"])
    assert again["decoding"] == "top2-1w" and again["rouge1"] == pytest.approx(final["top2-1w"]["rouge1"])
    best3 = evaluate.main(["--checkpoint", str(out), "--split", "validation", "--out", str(tmp_path / "ev3")])
    assert best3["rouge1"] < final["top2-1w"]["rouge1"] - 20


def test_the_ablation_reads_an_extractive_runs_scores():
    assert _final_metric({"loss": 0.4, "top3": {"rouge1": 37.0}}, "rouge1") == ("rouge1", {"loss": 0.4, "rouge1": 37.0})
    assert _final_metric({"loss": 0.4, "top4-60w": {"rouge1": 40.0}}, "rouge1")[1]["rouge1"] == 40.0
    assert _final_metric({"loss": 0.4, "greedy": {"bleu": 30.0}}, None)[1]["bleu"] == 30.0
