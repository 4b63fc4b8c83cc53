"""The BitNet model: per-architecture config, weight upload, forward pass, GPU decode loop, numpy reference."""
