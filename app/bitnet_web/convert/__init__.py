"""Model sources turned into what the model loads: Hugging Face checkpoints; synthetic models for tests and bench."""
