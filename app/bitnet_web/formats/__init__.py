"""File formats, numpy + stdlib only: GGUF/GGML constants (ggml), GGUF reader and writer, quant codecs, safetensors."""
