"""Other projects' weight formats <-> llamatron checkpoints: Hugging Face directories (import-hf, export-hf, the
Hub upload), Meta's consolidated files and Megatron-LM runs (import-megatron).

`hf.py` applies each family's Hugging Face format (models/families/*/hf.py, spoken in models/hf_format.py's
vocabulary) to config.json and the weights; `hf_io.py` streams the tensors between a directory and a checkpoint
(the format is checkpoint/'s: this package reads and writes it through checkpoint.reader and tensor_io);
`meta_consolidated.py` and `megatron.py` present Meta's and Megatron-LM's tensors under Hugging Face names, so
their imports go through the same rules and writer.
"""
