"""The model: configuration (`config`), layers (`layers`), the checks at its boundary (`checks`), the
encoder-decoder Transformer, the classifier and the extractive summarizer (`transformer`), several of one
kind as one (`ensemble`), and batched decoding (`decoding`, `beam`, `sampling`).

    from scratchformer.model import build_model, get_config
    model = build_model(get_config("small", src_vocab_size=8000), device="cuda")  # model.ops.name == "triton"
"""

from .beam import beam_search, beam_search_nbest
from .caches import DecoderState, KVCache, StaticKVCache
from .checks import check_batch
from .config import BOS_ID, EOS_ID, PAD_ID, PRESETS, UNK_ID, ModelConfig, get_config
from .decoding import greedy_decode
from .ensemble import Ensemble
from .layers import (
    AddNorm,
    DecoderLayer,
    Embedding,
    EncoderLayer,
    FeedForward,
    MultiHeadAttention,
    attention_weights,
)
from .sampling import Sampling, row_key, sample_decode
from .transformer import (
    Classifier,
    Decoder,
    Encoder,
    Extractor,
    Transformer,
    build_model,
    count_parameters,
)

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "UNK_ID", "PRESETS", "ModelConfig", "get_config",
    "greedy_decode", "beam_search", "beam_search_nbest", "sample_decode", "Sampling", "row_key", "Ensemble",
    "AddNorm", "DecoderLayer", "DecoderState", "Embedding", "EncoderLayer", "FeedForward", "KVCache",
    "MultiHeadAttention", "StaticKVCache", "attention_weights",
    "Classifier", "Decoder", "Encoder", "Extractor", "Transformer", "build_model", "check_batch",
    "count_parameters",
]
