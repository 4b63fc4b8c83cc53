"""bitnet-web: BitNet b1.58 language models on WebGPU, from Python."""

__version__ = "0.1.0"
