"""Data: sources (`datasets`; what an example of each task holds: `records`; the synthetic task:
`synthetic`), byte-level BPE tokenizers (`tokenizer`) and their seeded BPE-dropout (`bpe_dropout`),
encoding (into `ragged` arrays) and batching (`batching`). It feeds training and imports nothing of
the model or of training.

    source = resolve_source("multi30k")                 # synthetic, a local folder, or the hub
    train = load_split(source, "train")                 # [Example(src, tgt, id)]
    toks = TokenizerPair(BPETokenizer.train(texts_for_tokenizer(train, "both"), 8000))
    ds, stats = encode_examples(train, source.task, toks.src, toks.tgt)
    loader = make_loader(ds, BucketBatchSampler(ds.lengths(), max_tokens=4096))   # Batch objects
"""

from .batching import (
    ENCODER_ONLY,
    Batch,
    BucketBatchSampler,
    EncodedDataset,
    ResegmentedDataset,
    TruncationStats,
    collate,
    encode_examples,
    make_loader,
    round_up,
)
from .bpe_dropout import SAMPLES_PER_WORD, WordSegmentations
from .datasets import (
    DEFAULT_TASK,
    EXTENSIONS,
    HUB,
    LOCAL_NAMES,
    SPLITS,
    DataError,
    DataSource,
    carve_validation,
    check_limit,
    check_split,
    find_split_file,
    has_split,
    infer_task,
    label_names,
    load_hub,
    load_split,
    local_folder,
    read_split,
    resolve_source,
    texts_for_tokenizer,
)
from .ragged import Ragged
from .records import FIELDS, TASKS, Example, check_record, prediction_ids
from .sentences import split_sentences
from .synthetic import DE_NUMBERS, EN_NUMBERS, SYNTHETIC_SIZES, synthetic_examples
from .tokenizer import (
    BOS_ID,
    EOS_ID,
    MIN_VOCAB,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    BPETokenizer,
    TokenizerPair,
)

__all__ = [
    # datasets
    "TASKS", "SPLITS", "EXTENSIONS", "FIELDS", "HUB", "LOCAL_NAMES", "DEFAULT_TASK", "EN_NUMBERS", "DE_NUMBERS",
    "SYNTHETIC_SIZES", "DataError", "Example", "DataSource", "synthetic_examples", "check_split", "check_limit",
    "check_record", "prediction_ids", "find_split_file", "read_split", "infer_task", "label_names", "local_folder",
    "load_hub", "resolve_source", "load_split", "has_split",
    "carve_validation", "texts_for_tokenizer",
    "split_sentences",
    # tokenizer, BPE-dropout
    "SAMPLES_PER_WORD", "WordSegmentations", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "SPECIAL_TOKENS", "MIN_VOCAB",
    "BPETokenizer", "TokenizerPair",
    # batching
    "Ragged", "ENCODER_ONLY", "EncodedDataset", "ResegmentedDataset", "TruncationStats", "encode_examples", "Batch",
    "collate", "BucketBatchSampler", "make_loader", "round_up",
]
