"""Inference and export: the export directory, beam search, translation, evaluation and the
Hugging Face export. Everything here runs the flat model (the pipeline engine cannot generate)."""
