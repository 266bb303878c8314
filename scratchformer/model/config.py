"""Model configuration: one dataclass and the reference presets.

Presets (parameter counts are asserted in tests/test_model.py):
- ``base``: the paper's base model; d_model 512, 6+6 layers, 8 heads, d_ff 2048, untied
  source/target/output embeddings with an output bias, no final norms:
  91,050,810 parameters at vocab 30,522.
- ``small``: 256, 4+4 layers, 8 heads, d_ff 1024, with final encoder and decoder norms:
  13,525,824 parameters at vocab 8,000.
- ``tiny``: 256, 3+3 layers, 4 heads, d_ff 1024.
- ``classifier``: encoder-only, 64, 2 layers, 2 heads, d_ff 128.

The extractive summarizer (``extractive=True``) is any preset's encoder with no decoder layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Special token ids shared by the tokenizers, the data pipeline and decoding: the tokenizer fixes them.
from ..op_checks import MAX_POSITIONS
from ..special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: F401


@dataclass
class ModelConfig:
    src_vocab_size: int = 8000
    tgt_vocab_size: int | None = None  # None: same as src_vocab_size
    d_model: int = 512
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6  # 0 for the encoder-only models: num_classes set, or extractive
    d_ff: int = 2048
    activation: str = "relu"  # "relu" (the paper) or "gelu"
    dropout: float = 0.1  # on sublayer outputs before the residual add, and on embeddings + PE
    attn_dropout: float = 0.0  # on attention probabilities (not in the paper; annotated-transformer uses it)
    ffn_dropout: float = 0.0  # between the two FFN projections
    # Word dropout: in training, each ordinary input token (source and decoder input) is replaced by
    # <unk> with this probability (Sennrich & Zhang 2019's low-resource regulariser; `layers.Embedding`).
    word_dropout: float = 0.0
    norm: str = "post"  # "post": LN(x + sublayer(x)), the paper's; "pre": x + sublayer(LN(x))
    final_norm: bool = False  # a LayerNorm after the last encoder and decoder layers (usual with "pre")
    layer_norm_eps: float = 1e-5
    # "none": separate src, tgt and output matrices; "decoder": tgt embedding = output projection;
    # "all": one matrix for src, tgt and output (needs a shared vocabulary).
    tie_embeddings: str = "none"
    output_bias: bool = True
    pos_encoding: bool = True  # False: the no-positional-encoding ablation
    # The pointer-generator output layer (copy.py): copy source tokens; needs a shared vocabulary.
    copy: bool = False
    max_len: int = 4096  # longest sequence accepted (PE is computed on the fly; this is a guard)
    pad_id: int = PAD_ID
    num_classes: int | None = None  # set for the encoder-only classifier
    extractive: bool = False  # the encoder-only extractive summarizer: scores each marked sentence
    kernel: str = "auto"  # backend of every hot path: auto | eager | torch | triton

    def __post_init__(self):
        if self.tgt_vocab_size is None:
            self.tgt_vocab_size = self.src_vocab_size
        for name in ("final_norm", "output_bias", "pos_encoding", "copy", "extractive"):
            if not isinstance(getattr(self, name), bool):  # "False" is truthy: a copy layer, a bias, a norm
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_sizes()
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.d_model % 2 != 0:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {self.norm!r}")
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {self.activation!r}")
        if self.tie_embeddings not in ("none", "decoder", "all"):
            raise ValueError(f"tie_embeddings must be 'none', 'decoder' or 'all', got {self.tie_embeddings!r}")
        if self.tie_embeddings == "all" and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "tie_embeddings='all' needs a shared vocabulary, but src_vocab_size "
                f"{self.src_vocab_size} != tgt_vocab_size {self.tgt_vocab_size}"
            )
        if self.copy and (self.n_decoder_layers == 0 or self.src_vocab_size != self.tgt_vocab_size):
            raise ValueError("copy needs an encoder-decoder model with one vocabulary for source and target, got "
                             + ("an encoder-only model" if self.n_decoder_layers == 0 else
                                f"src_vocab_size {self.src_vocab_size} != tgt_vocab_size {self.tgt_vocab_size}"))
        for name in ("dropout", "attn_dropout", "ffn_dropout", "word_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        if self.kernel not in ("auto", "eager", "torch", "triton"):
            raise ValueError(f"unknown kernel backend {self.kernel!r}; choose auto, eager, torch or triton")

    def _check_sizes(self) -> None:
        """Sizes are positive integers (layers: >= 0; no decoder only for the encoder-only models)."""
        lows = dict(src_vocab_size=1, tgt_vocab_size=1, d_model=1, n_heads=1, n_encoder_layers=0, n_decoder_layers=0,
                    d_ff=1, max_len=1)
        if self.num_classes is not None:
            lows["num_classes"] = 2
        for name, lo in lows.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.pos_encoding and self.max_len > MAX_POSITIONS:  # a position is its index: 0 .. max_len - 1
            raise ValueError(f"max_len {self.max_len} is over the sinusoidal positions' limit, {MAX_POSITIONS} "
                             "(op_checks.MAX_POSITIONS, where the embedding's float sinusoid stops being accurate)")
        if self.extractive and self.num_classes is not None:
            raise ValueError("extractive and num_classes are both set: a model is a classifier or an extractive "
                             "summarizer, not both")
        encoder_only = "the classifier" if self.num_classes is not None else "the extractive summarizer"
        if self.n_decoder_layers == 0 and self.num_classes is None and not self.extractive:
            raise ValueError("n_decoder_layers is 0: only the encoder-only models (num_classes set, or extractive) "
                             "have no decoder")
        if self.pad_id != PAD_ID:  # kept for the configs saved with it; the loss and masks use PAD_ID
            raise ValueError(f"pad_id is the tokenizer's <pad> id, {PAD_ID}; got {self.pad_id!r}")
        if (self.num_classes is not None or self.extractive) and self.n_decoder_layers:
            raise ValueError(f"{encoder_only} has no decoder, but n_decoder_layers is {self.n_decoder_layers}: "
                             "set it to 0")
        if not (isinstance(self.layer_norm_eps, (int, float)) and 0 < self.layer_norm_eps < float("inf")):
            raise ValueError(f"layer_norm_eps must be a positive finite number, got {self.layer_norm_eps!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)


PRESETS: dict[str, dict] = {
    "base": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048),
    "small": dict(d_model=256, n_heads=8, n_encoder_layers=4, n_decoder_layers=4, d_ff=1024, final_norm=True),
    "tiny": dict(d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=1024),
    "classifier": dict(
        d_model=64, n_heads=2, n_encoder_layers=2, n_decoder_layers=0, d_ff=128, num_classes=2, final_norm=True
    ),
}


def get_config(preset: str, **overrides) -> ModelConfig:
    """A preset with keyword overrides (vocab sizes, dropout, kernel, ...)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[preset], **overrides})
