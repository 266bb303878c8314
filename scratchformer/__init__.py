"""scratchformer: an encoder-decoder Transformer from scratch, with our own Triton and CUDA kernels."""

__version__ = "0.1.0"
