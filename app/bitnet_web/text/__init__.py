"""Text around the model, numpy + stdlib only: tokenizers, chat templates, sampling and stop strings."""
