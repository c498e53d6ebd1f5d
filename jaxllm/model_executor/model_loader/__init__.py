"""Loading a checkpoint offline: HF directories, GGUF files, the embedded default model
(`loader.load_model`), the tokenizer and the tiny random test model."""
